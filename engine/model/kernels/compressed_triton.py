"""y = x @ W^T with W held compressed in device memory (`engine.model.compressed_weight.CompressedBF16`):
each program decodes its BLOCK_N x BLOCK_K tiles of W in registers — a sign+mantissa byte and a 4-bit
exponent code per weight, exponent = base + code, an escape (code 15) as 0 — with integer operations
only, and multiplies them in bfloat16 on the tensor cores with float32 sums. The escaped weights (rare)
are added after, by a sparse product in torch. The weights cross HBM at ~12 bits instead of 16 (a decode
step of a bandwidth-bound model reads 0.75 of the bytes); nothing is materialised in bfloat16.

Split-K (`quant_triton.split_k_for`): with a few rows (decode) there are too few (row, column) tiles to
fill the GPU, so each program takes a share of K and writes float32 partial sums that are added after.

`PLAIN=True` is the same kernel reading an ordinary bfloat16 W: on a matrix without escapes the two are
bit-identical in the Triton interpreter (same tiles, same order of accumulation); tests hold both close
to a float64 product. Activations are taken in bfloat16 (the engine's dtype with `--compress-weights`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.model.kernels.quant_triton import split_k_for

BLOCK_M = 16
BLOCK_N = 64
BLOCK_K = 128


@triton.jit
def _weights(plane_ptr, rn, kk, code, base, N, K):
    """bfloat16 weights of rows `rn`, columns `kk` from their planes and codes; 0 at escapes and outside."""
    wmask = (rn[:, None] < N) & (kk[None, :] < K)
    plane = tl.load(plane_ptr + rn[:, None] * K + kk[None, :], mask=wmask, other=0).to(tl.int32)
    bits = ((plane & 0x80) << 8) | ((base + code) << 7) | (plane & 0x7F)
    bits = tl.where((code == 15) | ~wmask, 0, bits)
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, plane_ptr, codes_ptr, y_ptr, M, N, K, base, stride_xm, code_row,
                   PLAIN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLIT_K: tl.constexpr, F32_DOT: tl.constexpr):
    """Program (m, n, s): rows m, columns n, the s-th share of K; float32 sums into y [SPLIT_K, M, N].
    Each K tile is two halves of 16-column runs (a code byte's low and high nibbles: `CompressedBF16.codes`),
    one dot each."""
    HALF: tl.constexpr = BLOCK_K // 2
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, HALF)
    xrows = rm[:, None] < M
    k_per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_start = pid_k * k_per
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + k_per, K), BLOCK_K):
        k_a = k0 + (j // 16) * 32 + j % 16
        k_b = k_a + 16
        x_a = tl.load(x_ptr + rm[:, None] * stride_xm + k_a[None, :], mask=xrows & (k_a[None, :] < K),
                      other=0.0).to(tl.bfloat16)
        x_b = tl.load(x_ptr + rm[:, None] * stride_xm + k_b[None, :], mask=xrows & (k_b[None, :] < K),
                      other=0.0).to(tl.bfloat16)
        if PLAIN:
            w_a = tl.load(w_ptr + rn[:, None] * K + k_a[None, :], mask=(rn[:, None] < N) & (k_a[None, :] < K),
                          other=0.0)
            w_b = tl.load(w_ptr + rn[:, None] * K + k_b[None, :], mask=(rn[:, None] < N) & (k_b[None, :] < K),
                          other=0.0)
        else:
            byte = tl.load(codes_ptr + rn[:, None] * code_row + (k0 // 2 + j)[None, :],
                           mask=(rn[:, None] < N) & (k_a[None, :] < K), other=0).to(tl.int32)
            w_a = _weights(plane_ptr, rn, k_a, byte & 0x0F, base, N, K)
            w_b = _weights(plane_ptr, rn, k_b, byte >> 4, base, N, K)
        if F32_DOT:  # (the interpreter: its bfloat16 dot is wrong; the same exact products in float32)
            acc += tl.dot(x_a.to(tl.float32), tl.trans(w_a.to(tl.float32)))
            acc += tl.dot(x_b.to(tl.float32), tl.trans(w_b.to(tl.float32)))
        else:
            acc += tl.dot(x_a, tl.trans(w_a))
            acc += tl.dot(x_b, tl.trans(w_b))
    tl.store(y_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def compressed_linear(x: torch.Tensor, w, plain: torch.Tensor | None = None, block_n: int = BLOCK_N,
                      block_k: int = BLOCK_K, warps: int = 4, stages: int = 3,
                      split_k: int | None = None) -> torch.Tensor:
    """x [M, K] @ W^T in float32, W a `CompressedBF16` (decoded per tile in the kernel, escapes added
    after), or with `plain` (a bfloat16 [N, K]) the same kernel reading it as is. The tile shape, warps,
    pipeline stages and K split are launch choices (the packing does not depend on them)."""
    n, k = w.shape
    m = x.shape[0]
    if block_k % 32:
        raise ValueError(f"block_k must be a multiple of 32 (the code bytes' runs), got {block_k}")
    x = x.contiguous()
    grid_m, grid_n = triton.cdiv(m, BLOCK_M), triton.cdiv(n, block_n)
    split = split_k or split_k_for(x.device, grid_m * grid_n, triton.cdiv(k, block_k))
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    _matmul_kernel[(grid_m, grid_n, split)](
        x, plain if plain is not None else w.plane, w.plane, w.codes, part, m, n, k, w.base, x.stride(0),
        w.codes.shape[1],
        PLAIN=plain is not None, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
        F32_DOT=x.device.type != "cuda", num_warps=warps, num_stages=stages)
    y = part[0] if split == 1 else part.sum(0)
    if plain is None and w.num_escapes:
        # the escaped weights: y[:, r] += x[:, c] * v for each (r, c, v)
        y.index_add_(1, w.esc_rows, x.index_select(1, w.esc_cols).to(torch.bfloat16).float() * w.esc_vals.float())
    return y
