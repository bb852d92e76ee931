"""Weight-only int8/int4 GEMM on the GPU (the CUDA path behind `engine.model.quant.linear`).

Each program multiplies a BLOCK_M x BLOCK_K tile of activations by a BLOCK_N x BLOCK_K tile of
weights dequantized in registers, so the weights cross HBM at 8 or 4 bits and are never
materialised in float. `dequant_halves` reads each code byte once, contiguously, and each row's
scale (and min) once per run of columns sharing it; `dequant_tile`, the first version, read a
scale and a min per weight and each int4 byte twice (on an H200 it ran Llama-3-8B's int4 decode
step at 172 ms, 30x the bfloat16 step) and remains only for group sizes that are not a power of two. int4 codes are in
`engine.model.quant`'s run layout: weight k of a row lives in byte (k // 32) * 16 + k % 16, low nibble
for k % 32 < 16, high otherwise. fp8 codes (e4m3) are read as the int8 path reads its bytes and widened
exactly by `e4m3_to_float` (bit placement into a float16, on any GPU: no FP8 instructions needed), so an
FP8 checkpoint moves half of bfloat16's bytes on every GPU; where the GPU has FP8 tensor cores,
`fp8_triton` multiplies FP8 by FP8 instead. Tested on CPU with the Triton interpreter against
`QuantizedWeight.dequantize_torch` (tests/test_triton_kernels.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.model.kernels.fp8_triton import e4m3_to_float
from engine.model.kernels.split_k import reduce_partials, split_k_for, store_tile


@triton.jit
def widen(code, FP8: tl.constexpr):
    """int8 codes or (FP8) e4m3 codes as float32."""
    if FP8:
        return e4m3_to_float(code)
    return code.to(tl.float32)


@triton.jit
def dequant_tile(q_ptr, s_ptr, m_ptr, rn, kk, N, K, groups, GROUP: tl.constexpr, INT4: tl.constexpr,
                 FP8: tl.constexpr = False):
    """float32 weights [len(rn), len(kk)] of rows `rn`, columns `kk` of one quantized [N, K] matrix
    (codes at q_ptr, row-major; per-group scales and mins [N, groups]); 0 outside N x K. Shared with
    the grouped-expert kernel (`moe_triton`), which points it at one expert's matrices."""
    wmask = (rn[:, None] < N) & (kk[None, :] < K)
    g = kk // GROUP
    scale = tl.load(s_ptr + rn[:, None] * groups + g[None, :], mask=wmask, other=0.0)
    if INT4:
        byte = (kk // 32) * 16 + kk % 16
        b = tl.load(q_ptr + rn[:, None] * (K // 2) + byte[None, :], mask=wmask, other=0).to(tl.int32)
        code = (b >> (4 * ((kk % 32) // 16))[None, :]) & 0x0F
        mn = tl.load(m_ptr + rn[:, None] * groups + g[None, :], mask=wmask, other=0.0)
        return code.to(tl.float32) * scale + mn
    code = tl.load(q_ptr + rn[:, None] * K + kk[None, :], mask=wmask, other=0)
    return widen(code, FP8) * scale


@triton.jit
def dequant_halves(q_ptr, s_ptr, m_ptr, rn, k0, N, K, groups,
                   GROUP: tl.constexpr, INT4: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, FP8: tl.constexpr = False):
    """The tile of rows `rn`, columns k0 .. k0 + BLOCK_K of one quantized [N, K] matrix, as two float32
    halves [BLOCK_N, BLOCK_K / 2] and their columns: (w_a, k_a, w_b, k_b); 0 outside N x K. Codes
    are read once each, contiguously (int4: the tile's bytes, low nibbles giving one half and high
    nibbles the other; int8: the tile's first and second halves), and each row's scale (and min)
    once per run of columns sharing it (GROUP a power of two), not once per weight. Loaded 2-D and
    viewed 3-D only to broadcast the scales: loading the runs 3-D made the tensor-core kernel 2.5x
    slower on an H200 (Llama-3-8B int4 decode b=32: 34.6 vs 13.7 ms). Shared by every method's
    kernel here and the grouped-expert kernel (`moe_triton`)."""
    HALF: tl.constexpr = BLOCK_K // 2
    SEG: tl.constexpr = 16 if INT4 else (GROUP if GROUP < HALF else HALF)  # columns of a half sharing a group
    NSEG: tl.constexpr = HALF // SEG
    rows = rn[:, None] < N
    j = tl.arange(0, HALF)
    seg = tl.arange(0, NSEG)
    if INT4:
        # byte k0/2 + j holds column k0 + (j // 16) * 32 + j % 16 (low nibble) and that + 16 (high).
        k_a = k0 + (j // 16) * 32 + j % 16
        k_b = k_a + 16
        b = tl.load(q_ptr + rn[:, None] * (K // 2) + (k0 // 2 + j)[None, :], mask=rows & (k_a[None, :] < K),
                    other=0)
        seg_k = k0 + seg * 32  # both halves of a 32-column run share its group (GROUP is a multiple of 32)
        smask = rows & (seg_k[None, :] < K)
        sidx = rn[:, None] * groups + (seg_k // GROUP)[None, :]
        scale = tl.load(s_ptr + sidx, mask=smask, other=0.0)[:, :, None]
        mn = tl.load(m_ptr + sidx, mask=smask, other=0.0)[:, :, None]
        lo = tl.reshape((b & 0x0F).to(tl.float32), (BLOCK_N, NSEG, SEG))
        hi = tl.reshape((b >> 4).to(tl.float32), (BLOCK_N, NSEG, SEG))
        w_a = tl.reshape(lo * scale + mn, (BLOCK_N, HALF))
        w_b = tl.reshape(hi * scale + mn, (BLOCK_N, HALF))
        return w_a, k_a, w_b, k_b
    k_a = k0 + j
    k_b = k_a + HALF
    c_a = tl.load(q_ptr + rn[:, None] * K + k_a[None, :], mask=rows & (k_a[None, :] < K), other=0)
    c_b = tl.load(q_ptr + rn[:, None] * K + k_b[None, :], mask=rows & (k_b[None, :] < K), other=0)
    seg_a = k0 + seg * SEG
    seg_b = seg_a + HALF
    s_a = tl.load(s_ptr + rn[:, None] * groups + (seg_a // GROUP)[None, :], mask=rows & (seg_a[None, :] < K),
                  other=0.0)[:, :, None]
    s_b = tl.load(s_ptr + rn[:, None] * groups + (seg_b // GROUP)[None, :], mask=rows & (seg_b[None, :] < K),
                  other=0.0)[:, :, None]
    w_a = tl.reshape(tl.reshape(widen(c_a, FP8), (BLOCK_N, NSEG, SEG)) * s_a, (BLOCK_N, HALF))
    w_b = tl.reshape(tl.reshape(widen(c_b, FP8), (BLOCK_N, NSEG, SEG)) * s_b, (BLOCK_N, HALF))
    return w_a, k_a, w_b, k_b


def packed_group(group_size: int) -> bool:
    """Whether `dequant_halves` takes this group size (a power of two); else `dequant_tile` reads
    a scale per weight."""
    return group_size & (group_size - 1) == 0


@triton.jit
def _wo_gemm_kernel(
    x_ptr, q_ptr, s_ptr, m_ptr, bias_ptr, y_ptr, part_ptr,
    M, N, K, stride_xm, stride_ym, groups,
    GROUP: tl.constexpr, INT4: tl.constexpr, HAS_BIAS: tl.constexpr, PACKED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    FP8: tl.constexpr = False,
):
    """SPLIT_K > 1: program (m, n, s) covers the s-th share of K and writes its float32 partial sums
    to `part` [SPLIT_K, M, N] (the caller sums them): a few rows (decode) then still fill the GPU."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_start = pid_k * k_per
    rows = rm[:, None] < M
    for k0 in range(k_start, tl.minimum(k_start + k_per, K), BLOCK_K):
        # Dequantized in float32, multiplied in the activations' dtype (bfloat16 tensor cores on CUDA).
        if PACKED:
            w_a, k_a, w_b, k_b = dequant_halves(q_ptr, s_ptr, m_ptr, rn, k0, N, K, groups, GROUP, INT4, BLOCK_N,
                                                BLOCK_K, FP8)
            x_a = tl.load(x_ptr + rm[:, None] * stride_xm + k_a[None, :], mask=rows & (k_a[None, :] < K), other=0.0)
            x_b = tl.load(x_ptr + rm[:, None] * stride_xm + k_b[None, :], mask=rows & (k_b[None, :] < K), other=0.0)
            acc += tl.dot(x_a, tl.trans(w_a.to(x_a.dtype)))
            acc += tl.dot(x_b, tl.trans(w_b.to(x_b.dtype)))
        else:
            kk = k0 + rk
            x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=rows & (kk[None, :] < K), other=0.0)
            w = dequant_tile(q_ptr, s_ptr, m_ptr, rn, kk, N, K, groups, GROUP, INT4, FP8).to(x.dtype)
            acc += tl.dot(x, tl.trans(w))
    store_tile(acc, rm, rn, M, N, bias_ptr, y_ptr, stride_ym, part_ptr, pid_k, SPLIT_K, HAS_BIAS)


@triton.jit
def _wo_gemv_kernel(
    x_ptr, q_ptr, s_ptr, m_ptr, bias_ptr, y_ptr, part_ptr,
    M, N, K, stride_xm, stride_ym, groups,
    GROUP: tl.constexpr, INT4: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, FP8: tl.constexpr = False,
):
    """One activation row per program (a decode step of one or two sequences): products summed in
    float32 registers shaped like the weight tile, no tensor-core dot (a single row would use a
    sixteenth of it) and no layout change of the weights; reduced once at the end."""
    row = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_K // 2), dtype=tl.float32)
    k_per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_start = pid_k * k_per
    for k0 in range(k_start, tl.minimum(k_start + k_per, K), BLOCK_K):
        w_a, k_a, w_b, k_b = dequant_halves(q_ptr, s_ptr, m_ptr, rn, k0, N, K, groups, GROUP, INT4, BLOCK_N,
                                            BLOCK_K, FP8)
        x_a = tl.load(x_ptr + row * stride_xm + k_a, mask=k_a < K, other=0.0).to(tl.float32)
        x_b = tl.load(x_ptr + row * stride_xm + k_b, mask=k_b < K, other=0.0).to(tl.float32)
        acc += w_a * x_a[None, :] + w_b * x_b[None, :]
    y = tl.sum(acc, axis=1)
    if SPLIT_K == 1:
        if HAS_BIAS:
            y += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_ym + rn, y.to(y_ptr.dtype.element_ty), mask=rn < N)
    else:
        tl.store(part_ptr + pid_k * M * N + row * N + rn, y, mask=rn < N)


@triton.jit
def _dequant_kernel(q_ptr, s_ptr, m_ptr, w_ptr, N, K, groups,
                    GROUP: tl.constexpr, INT4: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    FP8: tl.constexpr = False):
    """w [N, K] (the output's dtype) = the quantized matrix dequantized, one BLOCK_N x BLOCK_K tile per
    program: for many rows (prefill), where one dequantization then the vendor GEMM beats
    dequantizing inside every row tile's program."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_a, k_a, w_b, k_b = dequant_halves(q_ptr, s_ptr, m_ptr, rn, tl.program_id(1) * BLOCK_K, N, K, groups, GROUP,
                                        INT4, BLOCK_N, BLOCK_K, FP8)
    rows = rn[:, None] < N
    tl.store(w_ptr + rn[:, None] * K + k_a[None, :], w_a.to(w_ptr.dtype.element_ty), mask=rows & (k_a[None, :] < K))
    tl.store(w_ptr + rn[:, None] * K + k_b[None, :], w_b.to(w_ptr.dtype.element_ty), mask=rows & (k_b[None, :] < K))


@dataclass(frozen=True)
class Tiles:
    """One launch shape (BLOCK_K a multiple of 32: int4 runs, two halves of 16+). `block_m` is unused
    by the one-row and dequantize methods."""

    block_m: int
    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 3


METHODS = ("gemv", "dot", "dequant", "per_weight")
# Rows up to which each row is its own program (`_wo_gemv_kernel`), and from which the weight is
# dequantized once and multiplied by torch's GEMM; between them the tensor-core tile kernel. From
# `python -m loadtest.bench_quant_gemm` on an H200 (Llama-3-8B matrices, each call inside a CUDA
# graph; loadtest/results/quantization/h200/bench_quant_gemm.txt): gemv beats the tiles at one row only (int4
# gate_up 72 vs 93 us) and loses from two; dequantize + GEMM ties the tiles at 64 rows and wins from
# 128 (int4 gate_up 180 vs 252 us; 2,048 rows 772 vs 2,988).
GEMV_MAX_ROWS = 1
DEQUANT_MIN_ROWS = 128


def method_for(rows: int, group_size: int) -> str:
    if not packed_group(group_size):
        return "per_weight"
    if rows <= GEMV_MAX_ROWS:
        return "gemv"
    return "dequant" if rows >= DEQUANT_MIN_ROWS else "dot"


def tiles_for(rows: int, method: str, kind: str = "int8") -> Tiles:
    """The launch shape per method (per_weight keeps the first version's tiles: its per-weight reads
    need more shared memory per stage). fp8's one-row kernel: 16 x 512, best or within 3% of the best of
    eleven shapes on three of Llama-3-8B's four matrices on an H200 (qkv 14.7 us against 20.7 at 64 x 128,
    gate/up 62.5 against 78.1; loadtest/results/quantization/h200/)."""
    if method == "per_weight":
        return Tiles(16, 64, 128) if rows <= 16 else Tiles(64, 64, 64)
    if method == "gemv":
        return Tiles(1, 16, 512, 4, 3) if kind == "fp8" else Tiles(1, 64, 128, 4, 3)
    if method == "dequant":
        return Tiles(1, 64, 128, 4, 1)
    return Tiles(16, 128, 128, 8, 3) if rows <= 16 else Tiles(64, 64, 128, 4, 3)


def wo_gemm(x: torch.Tensor, kind: str, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
            group_size: int, bias: torch.Tensor | None, out: torch.Tensor, split_k: int | None = None,
            tiles: Tiles | None = None, method: str | None = None) -> None:
    """out [M, N] (row-strided view allowed) = x [M, K] @ dequant(W)^T (+ bias). `method`: None picks
    (`method_for`; benchmarks and tests name one of METHODS); `split_k`: None picks (`split_k_for`:
    only when few rows leave the GPU idle); `tiles`: None picks (`tiles_for`)."""
    m, k = x.shape
    n = q.shape[0]
    x = x.contiguous()
    how = method or method_for(m, group_size)
    if how not in METHODS:
        raise ValueError(f"unknown weight-only GEMM method {how!r} (one of {', '.join(METHODS)})")
    if how != "per_weight" and not packed_group(group_size):
        raise ValueError(f"group size {group_size} is not a power of two: only per_weight reads take it")
    t = tiles or tiles_for(m, how, kind)
    minp = mins if mins is not None else scales
    int4, fp8 = kind == "int4", kind == "fp8"
    if fp8:
        q = q.view(torch.uint8)  # (the bytes; `e4m3_to_float` widens them)
    if how == "dequant":
        w = torch.empty(n, k, dtype=x.dtype, device=x.device)
        _dequant_kernel[(triton.cdiv(n, t.block_n), triton.cdiv(k, t.block_k))](
            q, scales, minp, w, n, k, scales.shape[1], GROUP=group_size, INT4=int4, BLOCK_N=t.block_n,
            BLOCK_K=t.block_k, FP8=fp8, num_warps=t.warps, num_stages=t.stages)
        out.copy_(torch.mm(x, w.t()) if bias is None else torch.addmm(bias, x, w.t()))
        return
    gemv = how == "gemv"
    grid_m = m if gemv else triton.cdiv(m, t.block_m)
    split = split_k or split_k_for(x.device, grid_m * triton.cdiv(n, t.block_n), triton.cdiv(k, t.block_k))
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else scales
    args = (x, q, scales, minp, bias if bias is not None else scales, out, part, m, n, k, x.stride(0), out.stride(0),
            scales.shape[1])
    grid = (grid_m, triton.cdiv(n, t.block_n), split)
    if gemv:
        _wo_gemv_kernel[grid](*args, GROUP=group_size, INT4=int4, HAS_BIAS=bias is not None, BLOCK_N=t.block_n,
                              BLOCK_K=t.block_k, SPLIT_K=split, FP8=fp8, num_warps=t.warps, num_stages=t.stages)
    else:
        _wo_gemm_kernel[grid](*args, GROUP=group_size, INT4=int4, HAS_BIAS=bias is not None,
                              PACKED=how == "dot", BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
                              SPLIT_K=split, FP8=fp8, num_warps=t.warps, num_stages=t.stages)
    if split > 1:
        reduce_partials(part, bias, out)
