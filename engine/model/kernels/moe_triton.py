"""Routed experts as two grouped GEMMs (the GPU path behind `moe.Experts`).

The step's (token, choice) slots are sorted by expert and each expert's run is padded to a
multiple of BLOCK_M, so every BLOCK_M-row tile belongs to one expert: a program multiplies its
tile by that expert's weights only, and experts no token chose cost no program. All index
arithmetic stays on the device with sizes bounded in advance (T*k + E*(BLOCK_M-1) padded
slots), so a step needs no host sync and the same launch fits a captured CUDA graph.
The torch reference is `moe.grouped_experts_reference`; tests hold the two equal.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Protocol

import torch
import triton
import triton.language as tl

from engine.model.kernels import compressed_triton
from engine.model.kernels.compressed_triton import (
    ESC_CHUNK,
    _stand_in,
    _unscale,
    _weight_halves,
    decompress,
    stand_ins_fit,
)
from engine.model.kernels.quant_triton import dequant_halves, dequant_tile, packed_group


class QuantizedStack(Protocol):
    """What the kernel reads of `quant.QuantizedStack` (kernels import nothing above them): a layer's
    experts' int8/int4 matrices stacked, codes [E, N, K or K/2], scales and mins [E, N, G]."""

    kind: str
    q: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    group_size: int


class CompressedStack(Protocol):
    """What the kernel reads of a `compressed_weight.CompressedBF16` holding a layer's experts' matrices
    stacked as rows ([E * N, K]: expert e's rows e*N .. e*N + N)."""

    plane: torch.Tensor
    codes: torch.Tensor
    base: int
    esc_start: torch.Tensor
    esc_rows: torch.Tensor
    esc_cols: torch.Tensor
    esc_vals: torch.Tensor

    @property
    def num_escapes(self) -> int: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


@triton.jit
def _dot(a, b, F32_DOT: tl.constexpr):
    """a @ b with float32 sums; F32_DOT (the Triton interpreter, whose bfloat16 dot is wrong — a bfloat16
    MoE interpreted came out ~1e12 off) in float32: the same exact products."""
    if F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, s_ptr, m_ptr, c_ptr, rows_ptr, tile_expert_ptr, scale_ptr,
    codes_ptr, esc_start_ptr, esc_rows_ptr, esc_cols_ptr, esc_vals_ptr, base, code_row,
    N, K, stride_am, stride_we, stride_wn, stride_wk, stride_se, groups, stride_cm,
    GATHER: tl.constexpr, HAS_SCALE: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr, INT4: tl.constexpr,
    PACKED: tl.constexpr, COMPRESSED: tl.constexpr, ESCAPES: tl.constexpr, F32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ESC_CHUNK: tl.constexpr,
    FAST: tl.constexpr = False, FP8: tl.constexpr = False,
):
    """C[slot] = A[row(slot)] @ W[expert(tile)]^T (* scale[slot]) for one BLOCK_M x BLOCK_N tile.
    rows[slot] < 0 marks padding. GATHER: A's row is rows[slot]; else A is already in slot order.
    QUANT: W is quantized (codes at w_ptr, per-group scales/mins at s_ptr/m_ptr, `stride_se` apart
    per expert), dequantized in registers by `quant_triton.dequant_halves` (PACKED: a power-of-two group)
    or `dequant_tile` (FP8: e4m3 codes, widened exactly). COMPRESSED: W is a `CompressedStack` (sign+mantissa planes at w_ptr, exponent codes
    at codes_ptr; expert e's rows e*N ..), decoded in registers as `compressed_triton` does, C float32,
    and the tile's escaped weights added after it is stored (atomic adds, scaled as the tile was); FAST:
    by the fast decode (`compressed_triton._weights_scaled`: the sums scaled back, the escapes' stand-ins
    taken back out with their adds)."""
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_expert_ptr + tile)
    if e < 0:
        return  # a tile past the step's padded slots
    slots = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(rows_ptr + slots)
    valid = rows >= 0
    a_rows = rows if GATHER else slots
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    HALF: tl.constexpr = BLOCK_K // 2
    j = tl.arange(0, HALF)  # (COMPRESSED: a half-tile's code bytes)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        k = k0 * BLOCK_K + tl.arange(0, BLOCK_K)
        if COMPRESSED or (QUANT and PACKED):  # the tile as two halves, in the activations' dtype
            if COMPRESSED:
                kk = k0 * BLOCK_K
                k_a = kk + (j // 16) * 32 + j % 16
                k_b = k_a + 16
                wrow = e * N + n  # (rows past this expert's N are masked as outside the matrix)
                w_a, w_b = _weight_halves(w_ptr, w_ptr, codes_ptr, wrow, kk, j, k_a, k_b, base, e * N + N, K,
                                          code_row, False, FAST)
            else:  # (bf16 tensor cores on CUDA)
                w_a, k_a, w_b, k_b = dequant_halves(w_ptr + e * stride_we, s_ptr + e * stride_se,
                                                    m_ptr + e * stride_se, n, k0 * BLOCK_K, N, K, groups, GROUP,
                                                    INT4, BLOCK_N, BLOCK_K, FP8)
            a_a = tl.load(a_ptr + a_rows[:, None] * stride_am + k_a[None, :],
                          mask=valid[:, None] & (k_a[None, :] < K), other=0.0)
            a_b = tl.load(a_ptr + a_rows[:, None] * stride_am + k_b[None, :],
                          mask=valid[:, None] & (k_b[None, :] < K), other=0.0)
            acc += _dot(a_a, tl.trans(w_a.to(a_a.dtype)), F32_DOT)
            acc += _dot(a_b, tl.trans(w_b.to(a_b.dtype)), F32_DOT)
        elif QUANT:
            a = tl.load(a_ptr + a_rows[:, None] * stride_am + k[None, :], mask=valid[:, None] & (k[None, :] < K),
                        other=0.0)
            w = dequant_tile(w_ptr + e * stride_we, s_ptr + e * stride_se, m_ptr + e * stride_se, n, k, N, K,
                             groups, GROUP, INT4, FP8)
            acc += _dot(a, tl.trans(w.to(a.dtype)), F32_DOT)
        else:
            a = tl.load(a_ptr + a_rows[:, None] * stride_am + k[None, :], mask=valid[:, None] & (k[None, :] < K),
                        other=0.0)
            w = tl.load(w_ptr + e * stride_we + n[None, :] * stride_wn + k[:, None] * stride_wk,
                        mask=(k[:, None] < K) & (n[None, :] < N), other=0.0)
            acc += _dot(a, w, F32_DOT)
    if COMPRESSED and FAST:
        acc = acc * _unscale(base)
    if HAS_SCALE:
        slot_scale = tl.load(scale_ptr + slots, mask=valid, other=0.0).to(tl.float32)
        acc *= slot_scale[:, None]
    tl.store(c_ptr + slots[:, None] * stride_cm + n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & (n[None, :] < N))
    if COMPRESSED:
        if ESCAPES:
            # c[slot, r] += a[row(slot), col] * v (* scale[slot]) for each escape (e*N + r, col, v) of the tile's
            # columns, into the tile just stored (the barrier: every thread's store is in first)
            tl.debug_barrier()
            first = e * N + pid_n * BLOCK_N
            lo = tl.load(esc_start_ptr + first)
            hi = tl.load(esc_start_ptr + tl.minimum(first + BLOCK_N, e * N + N))
            ee = tl.arange(0, ESC_CHUNK)
            for e0 in range(lo, hi, ESC_CHUNK):
                em = e0 + ee < hi
                r = tl.load(esc_rows_ptr + e0 + ee, mask=em, other=0) - e * N
                col = tl.load(esc_cols_ptr + e0 + ee, mask=em, other=0)
                v = tl.load(esc_vals_ptr + e0 + ee, mask=em, other=0.0)
                both = valid[:, None] & em[None, :]
                av = tl.load(a_ptr + a_rows[:, None] * stride_am + col[None, :], mask=both, other=0.0)
                add = av.to(tl.float32) * v.to(tl.float32)[None, :]
                if FAST:
                    add -= av.to(tl.float32) * _stand_in(v, base)[None, :]
                if HAS_SCALE:
                    add = add * slot_scale[:, None]
                tl.atomic_add(c_ptr + slots[:, None] * stride_cm + r[None, :], add, mask=both)


# The compressed experts' decode: "fast" (`compressed_triton._weights_scaled`) or "select". Fewer
# instructions per weight (loadtest/triton_aot.py); on an H200 the DeepSeek-V2-Lite-shaped decode step
# (64 experts compressed) at batch 16/32 took 17.19-17.52 / 19.10-19.19 ms against select's 17.51-17.57 /
# 19.29-19.34 (loadtest/results/compression/h200/bench_gpu_tiles_decode.txt).
EXPERTS_DECODE = "fast"
# From this many padded BLOCK_M-row blocks per expert on average (a prefill's tokens), the compressed stacks
# are decoded to bfloat16 instead — whole experts at a time, at most compressed_triton.DECOMPRESS_CHUNK
# weights (`decompress`, the dense layers' many-rows decoder) — for the plain grouped GEMM: each weight is
# then decoded once, where the tiles decode it again for every block of its expert's rows, and the decoder
# writes at the rate of a copy (loadtest/results/compression/h200/bench_compressed_decoder_launches.txt). From 2 blocks the
# in-register decode does at least twice the decoding of the stacks' every expert. Chosen by that count,
# not yet timed (the DeepSeek-V2-Lite-shape prefill of 2,048 tokens — 3 blocks per expert — took 101-112 ms
# compressed against 64.8 plain on an H200: loadtest/results/compression/h200/bench_compressed_decoder.txt); 0: never.
DECODED_EXPERTS_MIN_BLOCKS = 2


def decodes_stacks(pairs: int, num_experts: int, block_m: int) -> bool:
    """Whether `fused_experts` decodes compressed stacks to bfloat16 for `pairs` (token, expert) choices."""
    return DECODED_EXPERTS_MIN_BLOCKS > 0 and pairs >= DECODED_EXPERTS_MIN_BLOCKS * num_experts * block_m


def align_to_experts(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded slot layout for `ids` [T, k].

    Returns (slot_of [P]: the flattened (token, choice) index each padded slot holds, -1 for
    padding; tile_expert [P / block_m]: the expert of each tile, -1 past the end; dest [T*k]: the
    padded slot of each flattened pair). P = T*k + E*(block_m - 1), rounded up to block_m.
    """
    flat = ids.flatten()
    n = flat.numel()
    dev = flat.device
    # (Not bincount: on CUDA it reads the largest id back to size its output, a host sync that
    # would keep decode steps of every MoE model out of CUDA graphs.)
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    seg_start = torch.cumsum(padded, 0) - padded  # each expert's first padded slot
    order = torch.argsort(flat, stable=True)
    first_of_expert = torch.cumsum(counts, 0) - counts
    sorted_e = flat[order]
    rank = torch.arange(n, device=dev) - first_of_expert[sorted_e]
    dest_sorted = seg_start[sorted_e] + rank
    total = -(-(n + num_experts * (block_m - 1)) // block_m) * block_m
    slot_of = torch.full((total,), -1, dtype=torch.long, device=dev)
    slot_of[dest_sorted] = order
    dest = torch.empty(n, dtype=torch.long, device=dev)
    dest[order] = dest_sorted
    tile_start = torch.arange(0, total, block_m, device=dev)
    ends = torch.cumsum(padded, 0)
    tile_expert = torch.searchsorted(ends, tile_start, right=True)
    tile_expert = torch.where(tile_expert < num_experts, tile_expert, torch.full_like(tile_expert, -1))
    return slot_of, tile_expert, dest


def _gemm(a: torch.Tensor, w: torch.Tensor | QuantizedStack | CompressedStack, rows: torch.Tensor,
          tile_expert: torch.Tensor, out_rows: int, gather: bool, scale: torch.Tensor | None, block_m: int,
          block_n: int, block_k: int, expert_rows: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
    """`expert_rows`: a `CompressedStack`'s rows per expert (N); its C is float32. `out`: C to write the
    tiles of `tile_expert`'s experts into (the others' rows left as they are), else a new one."""
    c_dtype = a.dtype
    cmpr = dict(COMPRESSED=False, ESCAPES=False)
    extra: tuple = (rows, rows, rows, rows, rows, 0, 0)  # (unused unless compressed)
    if hasattr(w, "plane"):
        assert not isinstance(w, torch.Tensor) and expert_rows > 0 and block_k % 32 == 0
        n, k, groups = expert_rows, w.plane.shape[1], 1
        ptrs = (w.plane, rows, rows)
        strides = (0, 0, 0, 0)
        quant = dict(QUANT=False, GROUP=1, INT4=False, PACKED=False)
        extra = (w.codes, w.esc_start, w.esc_rows, w.esc_cols, w.esc_vals, w.base, w.codes.shape[1])
        cmpr = dict(COMPRESSED=True, ESCAPES=w.num_escapes > 0,
                    FAST=EXPERTS_DECODE == "fast" and stand_ins_fit(w.base))
        c_dtype = torch.float32  # (escapes are added to it atomically)
    elif not isinstance(w, torch.Tensor):
        n, k = w.scales.shape[1], w.q.shape[2] * (2 if w.kind == "int4" else 1)
        groups = w.scales.shape[2]
        codes = w.q.view(torch.uint8) if w.kind == "fp8" else w.q  # (e4m3 bytes, widened in the kernel)
        ptrs = (codes, w.scales, w.mins if w.mins is not None else w.scales)
        strides = (w.q.stride(0), 0, 0, w.scales.stride(0))
        quant = dict(QUANT=True, GROUP=w.group_size, INT4=w.kind == "int4", PACKED=packed_group(w.group_size),
                     FP8=w.kind == "fp8")
    else:
        n, k, groups = w.shape[1], w.shape[2], 1
        ptrs = (w, w, w)  # (no scales or mins)
        strides = (w.stride(0), w.stride(1), w.stride(2), 0)
        quant = dict(QUANT=False, GROUP=1, INT4=False, PACKED=False)
    c = torch.empty(out_rows, n, dtype=c_dtype, device=a.device) if out is None else out
    grid = (tile_expert.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, *ptrs, c, rows, tile_expert, scale if scale is not None else rows, *extra,
        n, k, a.stride(0), *strides, groups, c.stride(0),
        GATHER=gather, HAS_SCALE=scale is not None, **quant, **cmpr, F32_DOT=a.device.type != "cuda",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, ESC_CHUNK=ESC_CHUNK,
    )
    return c


def _gemm_decoded(a: torch.Tensor, w: CompressedStack, rows: torch.Tensor, tile_expert: torch.Tensor, out_rows: int,
                  gather: bool, scale: torch.Tensor | None, block_m: int, block_n: int, block_k: int,
                  expert_rows: int, num_experts: int) -> torch.Tensor:
    """`_gemm` over a compressed stack decoded to bfloat16 a chunk of whole experts at a time, each chunk
    through the plain grouped GEMM for the tiles of its experts (C in a's dtype, as the plain stacks')."""
    k = w.plane.shape[1]
    per = max(1, compressed_triton.DECOMPRESS_CHUNK // (expert_rows * k))
    c = torch.empty(out_rows, expert_rows, dtype=a.dtype, device=a.device)
    none = torch.full_like(tile_expert, -1)
    for e0 in range(0, num_experts, per):
        e1 = min(num_experts, e0 + per)
        stack = decompress(w, e0 * expert_rows, e1 * expert_rows).view(e1 - e0, expert_rows, k).to(a.dtype)
        local = torch.where((tile_expert >= e0) & (tile_expert < e1), tile_expert - e0, none)
        _gemm(a, stack, rows, local, out_rows, gather, scale, block_m, block_n, block_k, out=c)
    return c


def fused_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                  w_gate_up: torch.Tensor | QuantizedStack | CompressedStack,
                  w_down: torch.Tensor | QuantizedStack | CompressedStack, act: Callable[[torch.Tensor], torch.Tensor],
                  block_m: int = 64, block_n: int = 64, block_k: int = 32, num_experts: int = 0) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]). x: [T, H]; w_gate_up: [E, 2I, H]; w_down: [E, H, I]
    (float, or each a `QuantizedStack` of the experts' int8/int4 matrices, or a `CompressedStack` of their
    bfloat16 ones as [E * 2I, H] and [E * H, I], with `num_experts`: decoded in the tiles, or from
    DECODED_EXPERTS_MIN_BLOCKS blocks per expert decoded to bfloat16 for the plain GEMM)."""
    t, k = ids.shape
    compressed = hasattr(w_gate_up, "plane")
    if compressed:
        if num_experts <= 0:
            raise ValueError("compressed expert stacks need num_experts")
        inter = w_gate_up.plane.shape[0] // num_experts // 2  # type: ignore[union-attr]
        rows = (2 * inter, w_down.plane.shape[0] // num_experts)  # type: ignore[union-attr]
    else:
        stacked = w_gate_up if isinstance(w_gate_up, torch.Tensor) else w_gate_up.scales  # type: ignore[union-attr]
        num_experts, inter = stacked.shape[0], stacked.shape[1] // 2
        rows = (0, 0)
    slot_of, tile_expert, _ = align_to_experts(ids, num_experts, block_m)
    token_rows = torch.where(slot_of >= 0, slot_of // k, slot_of)
    gemm = _gemm
    if compressed and decodes_stacks(t * k, num_experts, block_m):
        gemm = partial(_gemm_decoded, num_experts=num_experts)
    gate_up = gemm(x, w_gate_up, token_rows, tile_expert, slot_of.numel(), True, None, block_m, block_n, block_k,
                   rows[0])
    h = (act(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype)
    slot_weight = torch.where(slot_of >= 0, weights.flatten()[slot_of.clamp(min=0)], torch.zeros_like(slot_of, dtype=weights.dtype))
    down = gemm(h, w_down, slot_of, tile_expert, slot_of.numel(), False, slot_weight, block_m, block_n, block_k,
                rows[1]).to(x.dtype)
    # Padding rows (garbage, never stored) go to a spare row t that is dropped.
    target = torch.where(slot_of >= 0, slot_of // k, torch.full_like(slot_of, t))
    down = torch.where((slot_of >= 0)[:, None], down, torch.zeros((), dtype=down.dtype, device=down.device))
    return torch.zeros(t + 1, x.shape[1], dtype=x.dtype, device=x.device).index_add_(0, target, down)[:t]
