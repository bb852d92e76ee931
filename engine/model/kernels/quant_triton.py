"""Weight-only int8/int4 GEMM on the GPU (the CUDA path behind `engine.model.quant.linear`).

Each program multiplies a BLOCK_M x BLOCK_K tile of activations by a BLOCK_N x BLOCK_K tile of
weights dequantized in registers (codes, group scale and min read per element's group), so the
weights cross HBM at 8 or 4 bits and are never materialised in float. int4 codes are in
`engine.model.quant`'s run layout: weight k of a row lives in byte (k // 32) * 16 + k % 16, low nibble
for k % 32 < 16, high otherwise. Tested on CPU with the Triton interpreter against
`QuantizedWeight.dequantize_torch` (tests/test_triton_kernels.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.model.kernels.triton_ops import splits_to_fill


@triton.jit
def dequant_tile(q_ptr, s_ptr, m_ptr, rn, kk, N, K, groups, GROUP: tl.constexpr, INT4: tl.constexpr):
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
    return code.to(tl.float32) * scale


@triton.jit
def _wo_gemm_kernel(
    x_ptr, q_ptr, s_ptr, m_ptr, bias_ptr, y_ptr, part_ptr,
    M, N, K, stride_xm, stride_ym, groups,
    GROUP: tl.constexpr, INT4: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
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
    for k0 in range(k_start, tl.minimum(k_start + k_per, K), BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                    other=0.0)
        # Dequantized in float32, multiplied in the activations' dtype (bfloat16 tensor cores on CUDA).
        w = dequant_tile(q_ptr, s_ptr, m_ptr, rn, kk, N, K, groups, GROUP, INT4).to(x.dtype)
        acc += tl.dot(x, tl.trans(w))
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :], acc, mask=mask)


def split_k_for(device: torch.device, programs: int, k_tiles: int) -> int:
    """K splits that give about two waves of programs over the GPU (`triton_ops.splits_to_fill`): a power
    of two, at most 8 and at most one per K tile; 1 on CPU."""
    want = splits_to_fill(device, programs)
    split = 1
    while split * 2 <= min(want, 8, k_tiles):
        split *= 2
    return split


def wo_gemm(x: torch.Tensor, kind: str, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
            group_size: int, bias: torch.Tensor | None, out: torch.Tensor, split_k: int | None = None) -> None:
    """out [M, N] (row-strided view allowed) = x [M, K] @ dequant(W)^T (+ bias). `split_k`: None picks
    (`split_k_for`: only when few rows leave the GPU idle)."""
    m, k = x.shape
    n = q.shape[0]
    x = x.contiguous()
    block_m = 16 if m <= 16 else 64
    block_n = 64
    block_k = 128 if m <= 16 else 64
    grid_mn = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = split_k or split_k_for(x.device, grid_mn, triton.cdiv(k, block_k))
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else scales
    _wo_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n), split)](
        x, q, scales, mins if mins is not None else scales, bias if bias is not None else scales, out, part,
        m, n, k, x.stride(0), out.stride(0), scales.shape[1],
        GROUP=group_size, INT4=kind == "int4", HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
    )
    if split > 1:
        total = part.sum(0)
        if bias is not None:
            total += bias.float()
        out.copy_(total)
