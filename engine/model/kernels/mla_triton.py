"""Absorbed latent-attention decode (DeepSeek-V2/V3) over the paged latent cache, in place.

The torch path (`mla.MLAttention.attend_absorbed`) gathers every page of a decode group into one
contiguous tensor per layer and step; this kernel reads each sequence's pages through its block
table instead. One program per (sequence, tile of HEAD_TILE query heads): all heads share the
single latent "KV head", so each page is read once per tile. Scores are `q_c · c + q_r · k_r`
(two dots, so the latent rank and the RoPE dims may be any powers of two >= 16), softmax online,
and the output is the latent-weighted sum `Σ p c` [B, heads, rank]; W_UV is applied by the caller.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.model.kernels.fp8_triton import e4m3_to_float
from engine.model.kernels.triton_ops import (
    _store_split,
    bytes_if_fp8,
    combine_splits,
    decode_splits,
    online_softmax,
    split_buffer,
)


@triton.jit
def _mla_decode_kernel(
    qc_ptr, qr_ptr, cache_ptr, tables_ptr, ctx_ptr, out_ptr, part_ptr, scale, heads,
    stride_qcb, stride_qch, stride_qrb, stride_qrh, stride_cb, stride_cs, stride_tb, stride_ob, stride_oh,
    RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_TILE: tl.constexpr, SPLITS: tl.constexpr,
    KV_FP8: tl.constexpr = False,
):
    """SPLITS > 1: split-KV, as `triton_ops._decode_attention_kernel` (each split's pages from the
    sequence's context length on the device; partials merged by `combine_splits`)."""
    seq = tl.program_id(0)
    split = tl.program_id(2)
    h = tl.program_id(1) * HEAD_TILE + tl.arange(0, HEAD_TILE)
    hmask = h < heads
    r = tl.arange(0, RANK)
    e = tl.arange(0, ROPE)
    s_off = tl.arange(0, BLOCK_SIZE)
    qc = tl.load(qc_ptr + seq * stride_qcb + h[:, None] * stride_qch + r[None, :], mask=hmask[:, None], other=0.0)
    qr = tl.load(qr_ptr + seq * stride_qrb + h[:, None] * stride_qrh + e[None, :], mask=hmask[:, None], other=0.0)
    ctx = tl.load(ctx_ptr + seq)
    m_i = tl.full([HEAD_TILE], float("-inf"), tl.float32)
    l_i = tl.zeros([HEAD_TILE], tl.float32)
    acc = tl.zeros([HEAD_TILE, RANK], tl.float32)
    pages = tl.cdiv(ctx, BLOCK_SIZE)
    per_split = tl.cdiv(pages, SPLITS)
    for j in range(split * per_split, tl.minimum((split + 1) * per_split, pages)):
        blk = tl.load(tables_ptr + seq * stride_tb + j)
        page = cache_ptr + blk * stride_cb + s_off[:, None] * stride_cs
        valid = j * BLOCK_SIZE + s_off < ctx
        c = tl.load(page + r[None, :], mask=valid[:, None], other=0)  # [BLOCK_SIZE, RANK]
        kr = tl.load(page + RANK + e[None, :], mask=valid[:, None], other=0)  # [BLOCK_SIZE, ROPE]
        if KV_FP8:  # (an e4m3 cache's bytes, widened exactly)
            c = e4m3_to_float(c).to(qc_ptr.dtype.element_ty)
            kr = e4m3_to_float(kr).to(qc_ptr.dtype.element_ty)
        s = (tl.dot(qc, tl.trans(c)) + tl.dot(qr, tl.trans(kr))) * scale  # [HEAD_TILE, BLOCK_SIZE]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax(s, m_i, l_i, acc, c)
    if SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(out_ptr + seq * stride_ob + h[:, None] * stride_oh + r[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=hmask[:, None])
    else:
        _store_split(part_ptr, seq, h, split, m_i, l_i, acc, hmask, heads, SPLITS, RANK)


def supported(rank: int, rope: int, block_size: int) -> bool:
    """tl.dot needs every dimension >= 16; aranges need powers of two."""
    return all(d >= 16 and d & (d - 1) == 0 for d in (rank, rope, block_size))


def mla_decode(q_c: torch.Tensor, q_r: torch.Tensor, layer_cache: torch.Tensor, block_tables: torch.Tensor,
               context_lens: torch.Tensor, scale: float, splits: int | None = None) -> torch.Tensor:
    """q_c: [B, heads, rank] (W_UK folded in), q_r: [B, heads, rope] (roped); layer_cache:
    [num_blocks, 1, block_size, 1, rank + rope]; splits: split-KV programs per (sequence, head tile)
    (None: `triton_ops.decode_splits`). Returns Σ p c: [B, heads, rank]."""
    b, heads, rank = q_c.shape
    rope, block_size = q_r.shape[-1], layer_cache.shape[2]
    q_c, q_r = q_c.contiguous(), q_r.contiguous()
    out = torch.empty_like(q_c)
    head_tile = 16
    tiles = triton.cdiv(heads, head_tile)
    splits = splits or decode_splits(q_c.device, b * tiles)
    part = split_buffer(b, heads, splits, rank, q_c.device) if splits > 1 else out
    cache, fp8 = bytes_if_fp8(layer_cache)
    _mla_decode_kernel[(b, tiles, splits)](
        q_c, q_r, cache, block_tables, context_lens, out, part, scale, heads,
        q_c.stride(0), q_c.stride(1), q_r.stride(0), q_r.stride(1), layer_cache.stride(0), layer_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        RANK=rank, ROPE=rope, BLOCK_SIZE=block_size, HEAD_TILE=head_tile, SPLITS=splits, KV_FP8=fp8,
    )
    if splits > 1:
        combine_splits(part, out, splits)
    return out
