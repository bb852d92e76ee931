"""Weight-only quantized matmul weights: the formats, quantizing, and the one matmul seam.

Decode streams every weight once per step, so its speed is bytes moved; keeping weights at 8 or
4 bits moves a quarter or an eighth of float32. Activations, norms, attention and the KV cache
stay in the model dtype: only matmul weights are quantized, and they are dequantized inside the
matmul (`kernels/cpu_ops.c` on CPU; elsewhere, or without a C compiler, by torch first).

Formats (all group-wise along K, one scale per `group_size` weights of a row):
- int8: `q` int8 [N, K], w = q * scale                           (GGUF Q8_0 / Q6_K / Q5_0 exactly)
- int4: `q` uint8 [N, K/2], w = q * scale + min, q in 0..15; each 16 bytes hold 32 weights,
  byte j = w[j] | w[j+16] << 4                                    (GGUF Q4_0 / Q4_1 / Q4_K exactly)
- fp8:  `q` float8_e4m3fn [N, K], w = q * scale                   (block-FP8 checkpoints exactly:
  DeepSeek-V3, Kimi-K2, Qwen3-*-FP8 ship e4m3 weights with one `weight_scale_inv` per 128 x 128
  block; here each row carries its block's scales, [N, K / 128], so any row split is exact and
  the kernels read one layout for all three formats). An e4m3 code widens to float exactly: the
  CPU kernels place its bits in a float16 (sign, 4 exponent and 3 mantissa bits at the top of
  float16's 5 and 10) and multiply by 2^8, the portable C loop and torch read a 256-entry table.

Checkpoint layout (written by the GGUF conversion; also how to ship a pre-quantized model): a
quantized `X.weight` is stored as `X.weight.qweight` (the codes above), `X.weight.scales` and, for
int4, `X.weight.mins` (float32 [N, K/group_size]); config.json carries
`"quantization_config": {"quant_method": "splitfire"}`. Format and group size follow from the
tensors' dtypes and shapes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from common.errors import ModelLoadError
from engine.model.kernels import cpu_ops, kernels

METHODS = ("int8", "int4", "fp8")
FP8_MAX = 448.0  # the largest finite float8_e4m3fn

QUANT_METHOD = "splitfire"
SUFFIXES = (".qweight", ".scales", ".mins")
# Up to this many rows the C kernels beat dequantizing the whole weight once and one float32 GEMM.
# AVX2 build (the panel GEMM from 8 rows), 2-core EPYC, SmolLM2 shapes, kernel / dequantize+GEMM us:
# int4 3072x576 at 64 rows 1361 / 2365, 128: 2718 / 3746, 256: 5455 / 6274, 512: 10929 / 11116;
# int4 576x1536 at 512: 5910 / 5345 (`python -m loadtest.bench_engine --gemm`). The plain C build
# (no AVX2) has only its simple tiles: int4 3072x576 at 16 rows 741 / 1903, at 64 2977 / 3498.
KERNEL_MAX_ROWS = 256
PLAIN_C_MAX_ROWS = 48
# The integer-dot kernel (int8 activations) wins at batch 1-2 only (measured 1.1-1.9x per matmul at
# one row, slower from 4: its per-block float work grows with the rows, weight traffic does not).
Q8X_MAX_ROWS = 2


@dataclass
class QuantizedWeight:
    """One [N, K] matmul weight kept quantized."""

    kind: str  # "int8" | "int4" | "fp8"
    q: torch.Tensor
    scales: torch.Tensor  # float32 [N, K / group_size]
    mins: torch.Tensor | None  # int4 only
    group_size: int
    _kernel: dict[bool, tuple] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n, k = self.shape
        if self.kind not in METHODS:
            raise ModelLoadError(f"unknown quantized format {self.kind!r}")
        step = 32 if self.kind == "int4" else 8
        dtype = {"int8": torch.int8, "int4": torch.uint8, "fp8": torch.float8_e4m3fn}[self.kind]
        if self.q.dtype != dtype:
            raise ModelLoadError(f"{self.kind} weight codes must be {dtype}, got {self.q.dtype}")
        if self.group_size % step or k % self.group_size or tuple(self.scales.shape) != (n, k // self.group_size):
            raise ModelLoadError(f"{self.kind} weight [{n}, {k}]: scales {tuple(self.scales.shape)} do not give a "
                                 f"group size that is a multiple of {step} dividing {k}")
        if self.kind == "int4" and (self.mins is None or self.mins.shape != self.scales.shape):
            raise ModelLoadError(f"int4 weight [{n}, {k}]: mins must have the scales' shape {tuple(self.scales.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.q.shape
        return n, (2 * k if self.kind == "int4" else k)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scales, self.mins) if t is not None)

    @classmethod
    def from_parts(cls, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None) -> QuantizedWeight:
        """The checkpoint layout: int8 codes are int8, int4 codes uint8 with half the columns."""
        if q.dtype == torch.int8:
            kind, k = "int8", q.shape[1]
        elif q.dtype == torch.uint8:
            kind, k = "int4", 2 * q.shape[1]
        elif q.dtype == torch.float8_e4m3fn:
            kind, k = "fp8", q.shape[1]
        else:
            raise ModelLoadError(f"quantized codes must be int8 (int8), uint8 (int4) or float8_e4m3fn (fp8), "
                                 f"got {q.dtype}")
        if q.ndim != 2 or scales.ndim != 2 or scales.shape[1] == 0 or k % scales.shape[1]:
            raise ModelLoadError(f"quantized weight codes {tuple(q.shape)} and scales {tuple(scales.shape)} disagree")
        return cls(kind, q.contiguous(), scales.float().contiguous(),
                   None if mins is None else mins.float().contiguous(), k // scales.shape[1])

    def narrow(self, rows: range | None, cols: range | None) -> QuantizedWeight:
        """Rows and/or columns of the weight (a tensor-parallel rank's slice), still quantized. Columns
        must fall on group boundaries (whole groups of codes and their scales)."""
        q, s, m = self.q, self.scales, self.mins
        if rows is not None:
            q, s, m = q[rows.start : rows.stop], s[rows.start : rows.stop], None if m is None else m[rows.start : rows.stop]
        if cols is not None:
            gs = self.group_size
            if cols.start % gs or len(cols) % gs:
                raise ModelLoadError(f"{self.kind} weight {self.shape}: columns {cols.start}..{cols.stop} do not fall on "
                                     f"its {gs}-column groups (tensor parallel needs whole groups per rank)")
            per = 2 if self.kind == "int4" else 1  # int4: two codes a byte, 32 columns in 16 bytes
            q = q[:, cols.start // per : cols.stop // per]
            s, m = s[:, cols.start // gs : cols.stop // gs], None if m is None else m[:, cols.start // gs : cols.stop // gs]
        return QuantizedWeight(self.kind, q.contiguous(), s.contiguous(), None if m is None else m.contiguous(),
                               self.group_size)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [len(rows) or N, K]."""
        n, k = self.shape
        count = n if rows is None else rows.numel()
        if self.q.device.type == "cpu" and cpu_ops.library() is not None:
            out = torch.empty(count, k, dtype=torch.float32)
            idx = None if rows is None else rows.to(torch.int64).contiguous()
            if self.kind == "int8":
                cpu_ops.dequant_i8(self.q, self.scales, self.group_size, idx, out)
            elif self.kind == "fp8":
                cpu_ops.dequant_f8(self.q, self.scales, self.group_size, idx, out)
            else:
                assert self.mins is not None
                cpu_ops.dequant_i4(self.q, self.scales, self.mins, self.group_size, idx, out)
            return out
        return self.dequantize_torch(rows)

    def dequantize_torch(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The reference: plain torch, any device."""
        q, s, m = self.q, self.scales, self.mins
        if rows is not None:
            q, s = q[rows], s[rows]
            m = None if m is None else m[rows]
        gs = self.group_size
        if self.kind in ("int8", "fp8"):  # (torch widens e4m3 exactly)
            w = q.float().view(q.shape[0], -1, gs) * s.unsqueeze(-1)
        else:
            assert m is not None
            w = unpack_int4(q).float().view(q.shape[0], -1, gs) * s.unsqueeze(-1) + m.unsqueeze(-1)
        return w.reshape(q.shape[0], -1)

    def kernel_call(self, bias: torch.Tensor | None, int8_activations: bool) -> tuple:
        """(C function, its weight-side arguments), made once per mode: a decode step makes ~120 of
        these calls, so the Python around each is kept to a few attribute reads. With
        `int8_activations` (and AVX2, 32-aligned groups) the integer-dot kernel, else the float one."""
        if self._kernel is None:
            self._kernel = {}
        if int8_activations not in self._kernel:
            mode = int8_activations and self._q8x_ok()
            lib = cpu_ops.library()
            assert lib is not None
            n, k = self.shape
            b = None if bias is None else bias.float().contiguous()
            mins = None if self.mins is None else self.mins.data_ptr()
            if mode:
                w_args: tuple = (self.q.data_ptr(), self.scales.data_ptr(), mins, n, self.group_size,
                                 int(self.kind == "int4"))
                fn = lib.sf_gemm_q8x
            elif self.kind == "int8":
                w_args = (self.q.data_ptr(), self.scales.data_ptr(), n, self.group_size)
                fn = lib.sf_gemm_i8
            elif self.kind == "fp8":
                w_args = (self.q.data_ptr(), self.scales.data_ptr(), n, self.group_size)
                fn = lib.sf_gemm_f8
            else:
                w_args = (self.q.data_ptr(), self.scales.data_ptr(), mins, n, self.group_size)
                fn = lib.sf_gemm_i4
            self._kernel[int8_activations] = (fn, k, n, w_args, None if b is None else b.data_ptr(), b)  # b: kept alive
        return self._kernel[int8_activations]

    def _q8x_ok(self) -> bool:
        lib = cpu_ops.library()
        return (lib is not None and bool(lib.sf_has_avx2()) and self.kind != "fp8" and self.shape[1] % 32 == 0
                and self.group_size % 32 == 0)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedWeight:
        """`fn` (a reordering of rows, e.g. RoPE's interleave) applied to codes, scales and mins alike:
        each row's quantization lives in its own row of each."""
        return QuantizedWeight(self.kind, fn(self.q).contiguous(), fn(self.scales).contiguous(),
                               None if self.mins is None else fn(self.mins).contiguous(), self.group_size)

    def to(self, device: torch.device) -> QuantizedWeight:
        if self.q.device == device and self.scales.device == device:
            return self
        return QuantizedWeight(self.kind, self.q.to(device), self.scales.to(device),
                               None if self.mins is None else self.mins.to(device), self.group_size)


def unpack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] in the 32-weight run layout -> codes uint8 [N, K]."""
    n = q.shape[0]
    runs = q.view(n, -1, 16)
    return torch.stack((runs & 0x0F, runs >> 4), dim=2).reshape(n, -1)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes (0..15) [N, K] -> uint8 [N, K/2] in the 32-weight run layout."""
    n, k = codes.shape
    runs = codes.to(torch.uint8).view(n, k // 32, 2, 16)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def quantize(w: torch.Tensor, kind: str, group_size: int) -> QuantizedWeight:
    """Round-to-nearest weight-only quantization of a float [N, K] weight: int8 symmetric per
    group (absmax / 127), int4 asymmetric per group (min..max over 15 steps), fp8 symmetric per
    group (absmax / 448, `quantize_fp8`)."""
    n, k = w.shape
    if k % group_size:
        raise ModelLoadError(f"cannot quantize a weight with {k} columns in groups of {group_size}")
    if kind == "fp8":
        return quantize_fp8(w, group_size)
    g = w.detach().float().reshape(n, k // group_size, group_size)
    if kind == "int8":
        scale = g.abs().amax(-1) / 127.0
        codes = torch.round(g / scale.clamp(min=1e-12).unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
        return QuantizedWeight("int8", codes.reshape(n, k).contiguous(), scale.contiguous(), None, group_size)
    if kind == "int4":
        lo, hi = g.amin(-1), g.amax(-1)
        scale = (hi - lo) / 15.0
        codes = torch.round((g - lo.unsqueeze(-1)) / scale.clamp(min=1e-12).unsqueeze(-1)).clamp(0, 15)
        return QuantizedWeight("int4", pack_int4(codes.reshape(n, k)), scale.contiguous(), lo.contiguous(), group_size)
    raise ModelLoadError(f"unknown quantization {kind!r} (supported: {', '.join(METHODS)})")


def quantize_fp8(w: torch.Tensor, group_size: int) -> QuantizedWeight:
    """e4m3 codes with one scale per row per `group_size` columns (absmax / 448). The published
    checkpoints share a scale over 128 x 128 blocks; this layout keeps a scale per row anyway, so a
    1 x 128 block costs no byte more, rounds each row to its own range, and needs no row alignment
    when tensor parallel splits rows (each rank quantizes exactly what one device would)."""
    n, k = w.shape
    g = w.detach().float().reshape(n, k // group_size, group_size)
    scale = (g.abs().amax(-1) / FP8_MAX).clamp(min=1e-12)
    codes = (g / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).reshape(n, k)
    return QuantizedWeight("fp8", codes.to(torch.float8_e4m3fn).contiguous(), scale.contiguous(), None, group_size)


def from_block_fp8(codes: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> QuantizedWeight:
    """A checkpoint's block-FP8 weight: e4m3 `codes` [N, K] and float32 `scale_inv` [ceil(N / rows),
    ceil(K / cols)] for `block` = (rows, cols). Column blocks become groups of gcd(K, cols) columns
    (DeepSeek-V3's 576-column matrices end in a half block), so every layout is kept exactly."""
    n, k = codes.shape
    br, bc = block
    grid = (-(-n // br), -(-k // bc))
    if tuple(scale_inv.shape) != grid:
        raise ModelLoadError(f"block scales of shape {tuple(scale_inv.shape)}: a {n}x{k} weight in {br}x{bc} blocks "
                             f"needs {grid}")
    group = math.gcd(k, bc)
    if group % 8:
        raise ModelLoadError(f"an FP8 weight with {k} columns in blocks of {bc}: groups of {group} columns are not "
                             "a multiple of 8, which the FP8 kernels read")
    per_row = scale_inv.float().repeat_interleave(br, 0)[:n]
    scales = per_row.repeat_interleave(bc // group, 1)[:, : k // group]
    return QuantizedWeight("fp8", codes.view(torch.float8_e4m3fn).contiguous(), scales.contiguous(), None, group)


def group_size_for(k: int, kind: str) -> int:
    """The default group: 32 for int4 (GGUF's Q4 blocks; coarser costs accuracy), 128 for int8
    (its error is small either way) and fp8 (the checkpoints' blocks), or the largest power of two
    from 32 up (fp8: 8 up) that divides K."""
    for g in ((32,) if kind == "int4" else (128, 64, 32, 16, 8) if kind == "fp8" else (128, 64, 32)):
        if k % g == 0:
            return g
    raise ModelLoadError(f"cannot quantize a weight with {k} columns: not a multiple of 32")


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight | None:
    """One weight from row blocks of the same format and group size (a fused q/k/v or gate/up);
    None when they differ (GGUF files mix formats per tensor) and the parts must stay separate."""
    first = parts[0]
    if any(p.kind != first.kind or p.group_size != first.group_size for p in parts):
        return None
    mins = None if first.mins is None else torch.cat([p.mins for p in parts if p.mins is not None])
    return QuantizedWeight(first.kind, torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]),
                           mins, first.group_size)


@dataclass
class QuantizedStack:
    """Same-format [N, K] weights stacked [E, ...] (a layer's experts), for kernels that pick a matrix
    by index on the device (`kernels/moe_triton.py`): codes [E, N, K or K/2], scales and mins [E, N, G]."""

    kind: str
    q: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    group_size: int

    @classmethod
    def of(cls, parts: list[QuantizedWeight]) -> QuantizedStack | None:
        """None when the parts differ in format or group size (kept as separate weights then)."""
        first = parts[0]
        if any(p.kind != first.kind or p.group_size != first.group_size or p.shape != first.shape for p in parts):
            return None
        mins = None if first.mins is None else torch.stack([p.mins for p in parts if p.mins is not None])
        return cls(first.kind, torch.stack([p.q for p in parts]), torch.stack([p.scales for p in parts]), mins,
                   first.group_size)

    def parts(self) -> list[QuantizedWeight]:
        """Each matrix as a `QuantizedWeight` viewing the stack (no copy)."""
        return [QuantizedWeight(self.kind, self.q[e], self.scales[e], None if self.mins is None else self.mins[e],
                                self.group_size) for e in range(self.q.shape[0])]


def w8a8_ok(w: QuantizedWeight) -> bool:
    """Whether the FP8 x FP8 kernel takes this fp8 weight: scale groups a power of two of 16 or more
    (one tensor-core dot per group)."""
    g = w.group_size
    return g >= 16 and g & (g - 1) == 0


def kernel_max_rows() -> int:
    """Most rows the C kernels take (0 without them)."""
    lib = cpu_ops.library()
    if lib is None:
        return 0
    return KERNEL_MAX_ROWS if lib.sf_has_avx2() else PLAIN_C_MAX_ROWS


def linear(x: torch.Tensor, parts: list[QuantizedWeight], bias: torch.Tensor | None,
           int8_activations: bool = False) -> torch.Tensor:
    """x [T, K] @ W^T (+ bias), W the row blocks `parts` stacked; output in x's dtype.
    `int8_activations`: on CPU, multiply codes by x rounded to int8 per 32-block (llama.cpp's way;
    about twice the speed of dequantizing weights to float, results within that rounding)."""
    rows = x.shape[0]
    gpu = kernels("quant_triton", x.device.type)
    if gpu is not None:  # CUDA (or the Triton interpreter in tests): dequantized in registers
        out = torch.empty(rows, sum(p.shape[0] for p in parts), dtype=x.dtype, device=x.device)
        fp8 = kernels("fp8_triton", x.device.type)
        start = 0
        for p in parts:
            n = p.shape[0]
            b = None if bias is None else bias[start : start + n]
            if p.kind == "fp8" and fp8 is not None and w8a8_ok(p) and fp8.method_for(rows, x.device) == "w8a8":
                fp8.w8a8_gemm(x, p.q, p.scales, p.group_size, b, out[:, start : start + n])
            else:
                gpu.wo_gemm(x, p.kind, p.q, p.scales, p.mins, p.group_size, b, out[:, start : start + n])
            start += n
        return out
    if x.device.type == "cpu" and rows <= kernel_max_rows():
        xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        threads = torch.get_num_threads()
        int8_activations = int8_activations and rows <= Q8X_MAX_ROWS
        if len(parts) == 1:
            fn, k, n, w_args, b_ptr, _ = parts[0].kernel_call(bias, int8_activations)
            out = torch.empty(rows, n)
            if fn(xf.data_ptr(), k, rows, k, *w_args, b_ptr, out.data_ptr(), n, threads):
                raise MemoryError("quantized matmul: no memory for the quantized activations")
        else:
            total = sum(p.shape[0] for p in parts)
            out = torch.empty(rows, total)
            start = 0
            for p in parts:
                n = p.shape[0]
                b = None if bias is None else bias[start : start + n]
                fn, k, n, w_args, b_ptr, _ = p.kernel_call(b, int8_activations)
                if fn(xf.data_ptr(), k, rows, k, *w_args, b_ptr, out.data_ptr() + 4 * start, total, threads):
                    raise MemoryError("quantized matmul: no memory for the quantized activations")
                start += n
        return out if x.dtype == torch.float32 else out.to(x.dtype)
    w = parts[0].dequantize() if len(parts) == 1 else torch.cat([p.dequantize() for p in parts])
    return F.linear(x, w.to(x.dtype), bias)
