"""y = x @ W^T with W held compressed in device memory (`engine.model.compressed_weight.CompressedBF16`):
each program decodes its BLOCK_N x BLOCK_K tiles of W in registers — a sign+mantissa byte and a 4-bit
exponent code per weight, the code looked up in the tensor's 16-entry table, escapes fetched at their rank
in the tile (a prefix sum of the tile's escape flags from the tile's first escape) — and multiplies them
in float32. The weights cross HBM at ~12 bits instead of 16 (a decode step of a bandwidth-bound model
reads 0.75 of the bytes); nothing is materialised in bfloat16.

`PLAIN=True` is the same kernel reading an ordinary bfloat16 W: the tests hold the two bit-identical
(same tiles, same order of accumulation) in the Triton interpreter on a CPU host, and both close to torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16


@triton.jit
def _decode_tile(plane_ptr, codes_ptr, table_ptr, esc_ptr, start_ptr, rn, kk, tile, N, K,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The float32 weights [BLOCK_N, BLOCK_K] of rows `rn`, columns `kk` (tile number `tile`); 0 outside."""
    wmask = (rn[:, None] < N) & (kk[None, :] < K)
    plane = tl.load(plane_ptr + rn[:, None] * K + kk[None, :], mask=wmask, other=0).to(tl.int32)
    byte = tl.load(codes_ptr + rn[:, None] * (K // 2) + (kk // 2)[None, :], mask=wmask, other=0).to(tl.int32)
    code = (byte >> (4 * (kk % 2))[None, :]) & 0x0F
    esc = (code == 15) & wmask
    flags = esc.to(tl.int32)
    row_count = tl.sum(flags, axis=1)
    row_first = tl.cumsum(row_count, axis=0) - row_count
    rank = row_first[:, None] + tl.cumsum(flags, axis=1) - flags
    first = tl.load(start_ptr + tile)
    exp = tl.load(table_ptr + code, mask=wmask, other=0)
    exp = tl.where(esc, tl.load(esc_ptr + first + rank, mask=esc, other=0), exp)
    bits = ((plane & 0x80) << 8) | (exp << 7) | (plane & 0x7F)
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32)


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, plane_ptr, codes_ptr, table_ptr, esc_ptr, start_ptr, y_ptr, M, N, K,
                   stride_xm, stride_ym, PLAIN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tiles_k = tl.cdiv(K, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t in range(0, tiles_k):
        kk = t * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                    other=0.0).to(tl.float32)
        if PLAIN:
            w = tl.load(w_ptr + rn[:, None] * K + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K),
                        other=0.0).to(tl.float32)
        else:
            w = _decode_tile(plane_ptr, codes_ptr, table_ptr, esc_ptr, start_ptr, rn, kk, pid_n * tiles_k + t, N, K,
                             BLOCK_N, BLOCK_K)
        acc += tl.dot(x, tl.trans(w))
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def compressed_linear(x: torch.Tensor, w, plain: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W^T in float32, W a `CompressedBF16` (decoded per tile in the kernel), or with `plain`
    (a bfloat16 [N, K]) the same kernel reading it as is."""
    n, k = w.shape
    m = x.shape[0]
    x = x.contiguous()
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, w.block_n))
    _matmul_kernel[grid](x, plain if plain is not None else w.plane, w.plane, w.codes, w.table, w.escapes,
                         w.tile_start, y, m, n, k, x.stride(0), y.stride(0), PLAIN=plain is not None,
                         BLOCK_M=BLOCK_M, BLOCK_N=w.block_n, BLOCK_K=w.block_k)
    return y
