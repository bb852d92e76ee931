"""splitfire's CPU kernels in C (`cpu_ops.c`: weight-only quantized matmul, fused residual add +
RMSNorm, paged decode attention), compiled on first use and called via ctypes.

Compiled on the machine that runs it (`-march=native`), so the AVX2/FMA path is used exactly
where the processor has it and the plain C loops elsewhere; the build is cached under
`$SPLITFIRE_HOME/kernels/` by a hash of the source, the compiler and the CPU flags, so it costs
about a second once per machine. Linked against the OpenMP runtime torch already loaded (same
soname), so both share one thread pool instead of spinning against each other.

torch's own `_weight_int8pack_mm` / `_weight_int4pack_mm_for_cpu` were measured first on this
project's AVX2 EPYC: 4-30x slower than float32 oneDNN (their AVX2 paths are scalar over
the batch), so they are not used.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger("splitfire.engine")

_SRC = Path(__file__).with_name("cpu_ops.c")
# The elementwise kernels (norm, RoPE + store, SiLU * up) are single-threaded and scalar where torch's
# are vectorised and parallel: they win on decode-sized rows only (call overhead is what they
# remove); prefill chunks keep torch's ops.
SMALL_ROWS = 64
# From this many activation rows a quantized matmul takes the panel GEMM instead of the tiles
# (AVX2 build): equal at 3-6 rows, 1.0-1.3x at 8, 1.3-1.5x at 16 (`python -m loadtest.bench_engine --gemm`).
PANEL_MIN_ROWS = 8
_P = ctypes.c_void_p
_I = ctypes.c_int


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _cache_dir() -> Path:
    home = os.environ.get("SPLITFIRE_HOME") or str(Path.home() / ".cache" / "splitfire")
    return Path(home) / "kernels"


def small(rows: int) -> bool:
    """Whether the elementwise C kernels should take a step of `rows` token rows."""
    return rows <= SMALL_ROWS and library() is not None


NATIVE = ("-march=native",)
# A build for any x86-64 (no AVX2/FMA): what a CPU without them runs. Tests build it to exercise the
# plain-C fallback on machines that have AVX2.
BASELINE = ("-march=x86-64", "-mtune=generic")


def build(arch: tuple[str, ...] = NATIVE, cache_dir: Path | None = None) -> ctypes.CDLL:
    """Compile `cpu_ops.c` for `arch` (cached by source, compiler, flags and CPU) and load it."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) found")
    flags = ["-O3", *arch, "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-lm"]
    key = hashlib.sha256(_SRC.read_bytes() + cc.encode() + " ".join(flags).encode() + _cpu_flags().encode())
    out = (cache_dir or _cache_dir()) / f"cpu_ops-{key.hexdigest()[:16]}.so"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        proc = subprocess.run([cc, *flags, str(_SRC), "-o", tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            os.unlink(tmp)
            raise RuntimeError(f"compiling {_SRC.name} with {cc} failed:\n{proc.stderr[-2000:]}")
        os.replace(tmp, out)  # atomic: a concurrent worker loads a complete file or builds its own
    lib = ctypes.CDLL(str(out))
    lib.sf_gemm_i8.argtypes = [_P, _I, _I, _I, _P, _P, _I, _I, _P, _P, _I, _I]
    lib.sf_gemm_i4.argtypes = [_P, _I, _I, _I, _P, _P, _P, _I, _I, _P, _P, _I, _I]
    lib.sf_gemm_f8.argtypes = [_P, _I, _I, _I, _P, _P, _I, _I, _P, _P, _I, _I]
    lib.sf_dequant_i8.argtypes = [_P, _P, _I, _I, _I, _P, _I, _P, _I]
    lib.sf_dequant_f8.argtypes = [_P, _P, _I, _I, _I, _P, _I, _P, _I]
    lib.sf_f8_table.argtypes = [_P]
    lib.sf_e4m3_from_f32.argtypes = [_P, _P, ctypes.c_int64]
    lib.sf_e4m3_from_f32.restype = None
    lib.sf_dequant_i4.argtypes = [_P, _P, _P, _I, _I, _I, _P, _I, _P, _I]
    lib.sf_gemm_q8x.argtypes = [_P, _I, _I, _I, _P, _P, _P, _I, _I, _I, _P, _P, _I, _I]
    lib.sf_gemm_q8x.restype = _I
    lib.sf_add_rmsnorm.argtypes = [_P, _P, _P, _P, _I, _I, ctypes.c_float]
    lib.sf_paged_decode.argtypes = [_P, _I, _I, _I, _I, _I, _P, _I, _P, _I, _P, ctypes.c_float, _I, _P, _I, _I]
    lib.sf_rope_store.argtypes = [_P, _I, _I, _I, _I, _P, _P, _P, _I, _I]
    lib.sf_rope_store.restype = _I
    lib.sf_silu_mul.argtypes = [_P, _P, _I, _I]
    lib.sf_silu_mul_ref.argtypes = [_P, _P, _I, _I]
    lib.sf_paged_decode.restype = _I
    for f in (lib.sf_gemm_i8, lib.sf_gemm_i4, lib.sf_gemm_f8, lib.sf_dequant_i8, lib.sf_dequant_f8, lib.sf_f8_table,
              lib.sf_dequant_i4, lib.sf_add_rmsnorm,
              lib.sf_silu_mul, lib.sf_silu_mul_ref):
        f.restype = None
    lib.sf_gemv_cbf16.argtypes = [_P, _I, _P, _P, _I, _I, _P, _P, _P, _I, _P, _I]
    lib.sf_gemv_cbf16.restype = None
    lib.sf_gemv_bf16.argtypes = [_P, _I, _P, _I, _P, _I]
    lib.sf_gemv_bf16.restype = None
    lib.sf_join16.argtypes = [_P, _P, _P, ctypes.c_int64, _I]
    lib.sf_join16.restype = None
    lib.sf_split16.argtypes = [_P, _P, _P, ctypes.c_int64, _I]
    lib.sf_split16.restype = None
    lib.sf_count_bytes.argtypes = [_P, ctypes.c_int64, _P]
    lib.sf_count_bytes.restype = None
    lib.sf_inflate_literals.argtypes = [_P, ctypes.c_int64, _P, ctypes.c_int64]
    lib.sf_inflate_literals.restype = ctypes.c_int64
    lib.sf_inflate_literals2.argtypes = [_P, ctypes.c_int64, _P, ctypes.c_int64] * 2
    lib.sf_inflate_literals2.restype = ctypes.c_int64
    lib.sf_deflate_literals.argtypes = [_P, ctypes.c_int64, _P, _P, _P, ctypes.c_int64, ctypes.c_int64]
    lib.sf_deflate_literals.restype = ctypes.c_int64
    lib.sf_crc32.argtypes = [_P, ctypes.c_int64, ctypes.c_uint32]
    lib.sf_crc32.restype = ctypes.c_uint32
    lib.sf_has_pclmul.restype = _I
    lib.sf_rans_encode.argtypes = [_P, ctypes.c_int64, _P, _P, _P, ctypes.c_int64, _P, _P]
    lib.sf_rans_encode.restype = ctypes.c_int64
    lib.sf_rans_decode.argtypes = [_P, _P, _P, _P, _P, ctypes.c_int64]
    lib.sf_rans_decode.restype = ctypes.c_int64
    lib.sf_has_avx2.restype = _I
    lib.sf_set_panel_min_rows.argtypes = [_I]
    lib.sf_set_panel_min_rows.restype = None
    lib.sf_set_panel_min_rows(PANEL_MIN_ROWS)
    return lib


@cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (no C compiler, or SPLITFIRE_CPU_KERNELS=0): then every caller
    takes its torch path (quantized weights: dequantize + float32 matmul) — same results, slower."""
    if os.environ.get("SPLITFIRE_CPU_KERNELS", "1") == "0":
        return None
    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")):
        log.warning("no C compiler found: quantized matmuls run through torch (slower); install gcc")
        return None
    lib = build(target_arch())
    log.info("CPU kernels loaded (AVX2+FMA path: %s)", bool(lib.sf_has_avx2()))
    return lib


def target_arch() -> tuple[str, ...]:
    """The -march the kernels are built for: this machine's (native), or SPLITFIRE_CPU_MARCH's (e.g.
    `haswell`: AVX2 + FMA code on an AVX-512 machine, to compare what an AVX2 host runs). A value that is
    not a bare architecture name is refused naming the variable; one the compiler does not know fails the
    build with the compiler's message."""
    march = os.environ.get("SPLITFIRE_CPU_MARCH", "").strip()
    if not march:
        return NATIVE
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", march):
        raise ValueError(f"SPLITFIRE_CPU_MARCH must be a -march name such as 'haswell' or 'x86-64-v3', got {march!r}")
    return (f"-march={march}",)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def dequant_i8(q: torch.Tensor, s: torch.Tensor, gs: int, rows: torch.Tensor | None, out: torch.Tensor) -> None:
    _dequant("sf_dequant_i8", q, s, gs, rows, out)


def dequant_f8(q: torch.Tensor, s: torch.Tensor, gs: int, rows: torch.Tensor | None, out: torch.Tensor) -> None:
    """float32 rows of an fp8 weight (`quant`'s layout: e4m3 codes [N, K], scales [N, K / gs])."""
    _dequant("sf_dequant_f8", q, s, gs, rows, out)


def _dequant(fn: str, q: torch.Tensor, s: torch.Tensor, gs: int, rows: torch.Tensor | None, out: torch.Tensor) -> None:
    """Rows `rows` (all when None) of a one-byte-per-weight matrix (int8 or e4m3 codes) as float32 into `out`."""
    lib = library()
    assert lib is not None
    n, k = q.shape
    nrows = n if rows is None else rows.numel()
    getattr(lib, fn)(_ptr(q), _ptr(s), n, k, gs, _ptr(rows), nrows, _ptr(out), torch.get_num_threads())


def f8_table(lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """The C kernels' e4m3 -> float table (256 floats), to hold against torch's own widening."""
    lib = lib or library()
    assert lib is not None
    out = torch.empty(256, dtype=torch.float32)
    lib.sf_f8_table(out.data_ptr())
    return out


def dequant_i4(q: torch.Tensor, s: torch.Tensor, mn: torch.Tensor, gs: int, rows: torch.Tensor | None,
               out: torch.Tensor) -> None:
    lib = library()
    assert lib is not None
    n, k = q.shape[0], q.shape[1] * 2
    nrows = n if rows is None else rows.numel()
    lib.sf_dequant_i4(_ptr(q), _ptr(s), _ptr(mn), n, k, gs, _ptr(rows), nrows, _ptr(out), torch.get_num_threads())


def _check_row(x: torch.Tensor, k: int) -> None:
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape != (k,):
        raise ValueError(f"one float32 CPU row of {k} is multiplied, not {x.dtype} {tuple(x.shape)} on {x.device}")


def gemv_cbf16(x: torch.Tensor, w, threads: int | None = None) -> torch.Tensor:
    """x [K] float32 @ W^T for W a `CompressedBF16` on the CPU, decoded in registers: y [N] float32."""
    lib = library()
    assert lib is not None
    n, k = w.shape
    _check_row(x, k)
    x = x.contiguous()
    y = torch.empty(n, dtype=torch.float32)
    lib.sf_gemv_cbf16(x.data_ptr(), k, w.plane.data_ptr(), w.codes.data_ptr(), w.codes.shape[1], w.base,
                      w.esc_start.data_ptr(), w.esc_cols.data_ptr(), w.esc_vals.data_ptr(), n, y.data_ptr(),
                      threads or torch.get_num_threads())
    return y


def gemv_bf16(x: torch.Tensor, w: torch.Tensor, threads: int | None = None) -> torch.Tensor:
    """x [K] float32 @ W^T for a plain bfloat16 W [N, K] on the CPU (the same loop as `gemv_cbf16`)."""
    lib = library()
    assert lib is not None
    n, k = w.shape
    _check_row(x, k)
    if w.dtype != torch.bfloat16 or w.device.type != "cpu":
        raise ValueError(f"gemv_bf16 takes a bfloat16 CPU matrix, not {w.dtype} on {w.device}")
    x, w = x.contiguous(), w.contiguous()
    y = torch.empty(n, dtype=torch.float32)
    lib.sf_gemv_bf16(x.data_ptr(), k, w.data_ptr(), n, y.data_ptr(), threads or torch.get_num_threads())
    return y


def add_rmsnorm(x: torch.Tensor, h: torch.Tensor | None, w: torch.Tensor, eps: float) -> torch.Tensor:
    """With h: x += h in place (the residual stream). Returns rmsnorm(x) * w. float32, contiguous."""
    lib = library()
    assert lib is not None
    out = torch.empty_like(x)
    rows, dim = x.shape
    lib.sf_add_rmsnorm(x.data_ptr(), None if h is None else h.data_ptr(), w.data_ptr(), out.data_ptr(), rows, dim, eps)
    return out


# The C kernels' KV cache element types (cpu_ops.c KV_F32, KV_F16, KV_E4M3).
KV_KINDS = {torch.float32: 0, torch.float16: 1, torch.float8_e4m3fn: 2}


@cache
def kv_supported(cache_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the C attention kernels read and write a KV cache of this dtype: float32 always,
    float16 and e4m3 with the AVX2 (+ F16C) build and head_dim % 8 == 0. (Asked per layer per step: cached.)"""
    lib = library()
    if lib is None:
        return False
    if cache_dtype == torch.float32:
        return True
    return cache_dtype in KV_KINDS and bool(lib.sf_has_avx2()) and head_dim % 8 == 0


def e4m3_from_float(x: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """float32 -> float8_e4m3fn as the C KV store rounds (to nearest even, saturating): held to torch's cast."""
    lib = lib or library()
    assert lib is not None
    x = x.float().contiguous()
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    lib.sf_e4m3_from_f32(x.data_ptr(), out.data_ptr(), x.numel())
    return out


def check(rc: int, what: str) -> None:
    """A kernel's return code as an exception."""
    if rc == -1:
        raise MemoryError(f"{what}: out of memory")
    if rc == -2:
        raise RuntimeError(f"{what}: this build of cpu_ops.c cannot use a float16 or e4m3 KV cache (needs AVX2 + F16C)")
    if rc != 0:
        raise RuntimeError(f"{what}: failed with code {rc}")


def paged_decode(q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, context_lens: torch.Tensor,
                 scale: float, window: int) -> torch.Tensor:
    """q [B, heads, D] float32, each row's heads contiguous (a view into a fused qkv row is fine); cache
    [blocks, 2, block_size, kv_heads, D] float32, float16 or e4m3 (see `kv_supported`); tables [B, max_blocks]
    and context_lens [B] int64. Returns [B, heads, D]."""
    lib = library()
    assert lib is not None
    b, h, d = q.shape
    assert q.stride(2) == 1 and q.stride(1) == d
    out = torch.empty(b, h, d)
    rc = lib.sf_paged_decode(q.data_ptr(), q.stride(0), b, h, cache.shape[3], d, cache.data_ptr(), cache.shape[2],
                             tables.data_ptr(), tables.shape[1], context_lens.data_ptr(), scale, window,
                             out.data_ptr(), KV_KINDS[cache.dtype], torch.get_num_threads())
    check(rc, "paged decode attention")
    return out


def rope_store(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, freqs: torch.Tensor,
               cache: torch.Tensor, k_rows: torch.Tensor, block_size: int) -> None:
    """Rotate q and k of `qkv` [T, (heads + 2 kv_heads) * head_dim] in place by `freqs` ([T, 1, D/2]
    complex64: cos + i sin per token) and store k and v at `k_rows` of the layer `cache`."""
    lib = library()
    assert lib is not None
    check(lib.sf_rope_store(qkv.data_ptr(), qkv.shape[0], heads, kv_heads, head_dim, freqs.data_ptr(),
                             cache.data_ptr(), k_rows.data_ptr(), block_size, KV_KINDS[cache.dtype]),
           "RoPE + KV store")


def silu_mul(gate_up: torch.Tensor, reference: bool = False) -> torch.Tensor:
    """SiLU(gate) * up of rows [gate | up]: vectorized exponentials (AVX2), or libm's `expf` per
    element with `reference` (what a test holds the fast path to, within a few ulp)."""
    t, two_i = gate_up.shape
    out = torch.empty(t, two_i // 2)
    lib = library()
    assert lib is not None
    (lib.sf_silu_mul_ref if reference else lib.sf_silu_mul)(gate_up.data_ptr(), out.data_ptr(), t, two_i // 2)
    return out
