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
    x_ptr, q_ptr, s_ptr, m_ptr, bias_ptr, y_ptr,
    M, N, K, stride_xm, stride_ym, groups,
    GROUP: tl.constexpr, INT4: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                    other=0.0).to(tl.float32)
        w = dequant_tile(q_ptr, s_ptr, m_ptr, rn, kk, N, K, groups, GROUP, INT4)
        acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def wo_gemm(x: torch.Tensor, kind: str, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
            group_size: int, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out [M, N] (row-strided view allowed) = x [M, K] @ dequant(W)^T (+ bias)."""
    m, k = x.shape
    n = q.shape[0]
    x = x.contiguous()
    block_m = 16 if m <= 16 else 64
    block_n, block_k = 64, 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _wo_gemm_kernel[grid](
        x, q, scales, mins if mins is not None else scales, bias if bias is not None else scales, out,
        m, n, k, x.stride(0), out.stride(0), scales.shape[1],
        GROUP=group_size, INT4=kind == "int4", HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
