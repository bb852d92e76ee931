"""Paged decode attention, KV page store, fused residual RMSNorm, interleaved RoPE.

Shapes follow the engine: the layer cache is `[num_blocks, 2, block_size, kv_heads, head_dim]`
(K and V of a block side by side), tokens are flattened `[T, heads, head_dim]`.
Kernels are specialised by Triton per head_dim, block size and GQA group (constexprs),
i.e. per loaded model. An e4m3 cache (`--kv-cache-dtype fp8`) is read as bytes and widened exactly in
registers (`fp8_triton.e4m3_to_float`, any GPU), and written rounded to nearest even (`e4m3_bits`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.model.kernels.fp8_triton import e4m3_bits, e4m3_to_float
from engine.model.kernels.split_k import splits_to_fill


@triton.jit
def _decode_attention_kernel(
    q_ptr, cache_ptr, tables_ptr, ctx_ptr, out_ptr, part_ptr, scale,
    stride_qt, stride_qh, stride_cb, stride_ckv, stride_cs, stride_ch, stride_tb, stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    WINDOW: tl.constexpr, KEYS: tl.constexpr, SPLITS: tl.constexpr, KV_FP8: tl.constexpr = False,
):
    """One program per (sequence, kv head, split of its keys): the GROUP query heads sharing that kv
    head read each key once, KEYS keys per tile gathered through the block table (a tile spans pages),
    scores and the weighted sum as tensor-core dots (the group padded to 16 rows), softmax online.
    With a WINDOW (> 0), only the last WINDOW keys count and keys before them are not read.

    SPLITS > 1 is split-KV ("flash decoding"): a sequence's tiles are shared out over SPLITS programs,
    so a small batch still fills the GPU; each writes its running max, sum and unnormalized output to
    `part` and `_combine_splits_kernel` merges them. The split sizes come from each sequence's own
    context length on the device, so a captured CUDA graph replays correctly at any length."""
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    t_off = tl.arange(0, KEYS)
    gmask = g < GROUP
    q = tl.load(q_ptr + seq * stride_qt + (kvh * GROUP + g)[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None], other=0.0)
    ctx = tl.load(ctx_ptr + seq)
    first_key = 0
    if WINDOW > 0:
        first_key = tl.maximum(ctx - WINDOW, 0)
    tiles = tl.cdiv(ctx - first_key, KEYS)
    per_split = tl.cdiv(tiles, SPLITS)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for j in range(split * per_split, tl.minimum((split + 1) * per_split, tiles)):
        t = first_key + j * KEYS + t_off
        valid = t < ctx
        blk = tl.load(tables_ptr + seq * stride_tb + t // BLOCK_SIZE, mask=valid, other=0)
        row = cache_ptr + blk.to(tl.int64) * stride_cb + kvh * stride_ch + (t % BLOCK_SIZE) * stride_cs
        k = tl.load(row[:, None] + d[None, :], mask=valid[:, None], other=0)
        v = tl.load(row[:, None] + stride_ckv + d[None, :], mask=valid[:, None], other=0)
        if KV_FP8:  # (e4m3 bytes, widened exactly, multiplied in the queries' dtype)
            k = e4m3_to_float(k).to(q_ptr.dtype.element_ty)
            v = e4m3_to_float(v).to(q_ptr.dtype.element_ty)
        s = tl.dot(q.to(k.dtype), tl.trans(k)) * scale  # [GROUP_PAD, KEYS], float32
        s = tl.where(valid[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax(s, m_i, l_i, acc, v)
    heads = kvh * GROUP + g
    if SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=gmask[:, None])
    else:
        _store_split(part_ptr, seq, heads, split, m_i, l_i, acc, gmask, tl.num_programs(1) * GROUP, SPLITS,
                     HEAD_DIM)


@triton.jit
def online_softmax(s, m_i, l_i, acc, v):
    """One tile of keys into a running softmax (flash attention): scores `s` [rows, keys] (-inf where masked;
    every row sees at least one key) against the running max `m_i`, sum `l_i` and unnormalized output `acc`,
    values `v` [keys, dim]. Returns the updated (m_i, l_i, acc)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _store_split(part_ptr, seq, heads, split, m_i, l_i, acc, hmask, num_heads, SPLITS: tl.constexpr,
                 DIM: tl.constexpr):
    """A split's partial result: [m, l, acc[DIM]] per (sequence, head, split), float32."""
    d = tl.arange(0, DIM)
    base = part_ptr + ((seq * num_heads + heads) * SPLITS + split) * (DIM + 2)
    tl.store(base, m_i, mask=hmask)
    tl.store(base + 1, l_i, mask=hmask)
    tl.store(base[:, None] + 2 + d[None, :], acc, mask=hmask[:, None])


@triton.jit
def _combine_splits_kernel(part_ptr, out_ptr, stride_ot, stride_oh, SPLITS: tl.constexpr, DIM: tl.constexpr):
    """One program per (sequence, head): the splits' partial softmaxes merged by their maxima."""
    seq = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS)
    d = tl.arange(0, DIM)
    base = part_ptr + ((seq * tl.num_programs(1) + h) * SPLITS + sp) * (DIM + 2)
    m = tl.load(base)
    l_s = tl.load(base + 1)
    acc = tl.load(base[:, None] + 2 + d[None, :])
    m_max = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.exp(m - m_max), 0.0)  # an empty split (short context) weighs nothing
    out = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l_s, axis=0)
    tl.store(out_ptr + seq * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def decode_splits(device: torch.device, programs: int) -> int:
    """How many splits of each sequence's keys fill the GPU: a power of two up to 16 (`splits_to_fill`).
    Fixed per batch shape, so a captured graph keeps it."""
    want = splits_to_fill(device, programs)
    return min(16, triton.next_power_of_2(want)) if want > 1 else 1


def split_buffer(b: int, heads: int, splits: int, dim: int, device: torch.device) -> torch.Tensor:
    return torch.empty(b * heads * splits * (dim + 2), dtype=torch.float32, device=device)


def combine_splits(part: torch.Tensor, out: torch.Tensor, splits: int) -> None:
    b, heads, dim = out.shape
    _combine_splits_kernel[(b, heads)](part, out, out.stride(0), out.stride(1), SPLITS=splits, DIM=dim)


def bytes_if_fp8(layer_cache: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """An e4m3 cache as its bytes (the kernels widen them), and whether it was one."""
    if layer_cache.dtype == torch.float8_e4m3fn:
        return layer_cache.view(torch.uint8), True
    return layer_cache, False


def paged_decode_attention(q: torch.Tensor, layer_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, window: int = 0,
                           splits: int | None = None) -> torch.Tensor:
    """q: [B, heads, dim]; block_tables: [B, max_blocks] int32/64; context_lens: [B]; window: sliding
    window in tokens (0 = none); splits: split-KV programs per sequence (None: `decode_splits`).
    Returns [B, heads, dim]."""
    b, heads, dim = q.shape
    kv_heads, block_size = layer_cache.shape[3], layer_cache.shape[2]
    group = heads // kv_heads
    splits = splits or decode_splits(q.device, b * kv_heads)
    out = torch.empty_like(q)
    part = split_buffer(b, heads, splits, dim, q.device) if splits > 1 else out
    cache, fp8 = bytes_if_fp8(layer_cache)
    _decode_attention_kernel[(b, kv_heads, splits)](
        q, cache, block_tables, context_lens, out, part, scale,
        q.stride(0), q.stride(1), layer_cache.stride(0), layer_cache.stride(1), layer_cache.stride(2),
        layer_cache.stride(3), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(triton.next_power_of_2(group), 16), BLOCK_SIZE=block_size, HEAD_DIM=dim,
        WINDOW=window, KEYS=max(block_size, 64), SPLITS=splits, KV_FP8=fp8,
    )
    if splits > 1:
        combine_splits(part, out, splits)
    return out


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, cache_ptr, blocks_ptr, slots_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ckv, stride_cs, stride_ch,
                     HEAD_DIM: tl.constexpr, KV_FP8: tl.constexpr = False):
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    blk = tl.load(blocks_ptr + t)
    slot = tl.load(slots_ptr + t)
    dst = cache_ptr + blk * stride_cb + slot * stride_cs + h * stride_ch + d
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d)
    if KV_FP8:
        tl.store(dst, e4m3_bits(k.to(tl.float32)))
        tl.store(dst + stride_ckv, e4m3_bits(v.to(tl.float32)))
    else:
        tl.store(dst, k.to(cache_ptr.dtype.element_ty))
        tl.store(dst + stride_ckv, v.to(cache_ptr.dtype.element_ty))


def store_kv(layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Write token t's K/V into page `blocks[t]`, slot `slots[t]`. k, v: [T, kv_heads, dim]."""
    t, kv_heads, dim = k.shape
    cache, fp8 = bytes_if_fp8(layer_cache)
    _store_kv_kernel[(t, kv_heads)](
        k, v, cache, blocks, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        layer_cache.stride(0), layer_cache.stride(1), layer_cache.stride(2), layer_cache.stride(3), HEAD_DIM=dim,
        KV_FP8=fp8,
    )


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n_cols, eps, stride_x, stride_r, stride_o,
                     HAS_RESIDUAL: tl.constexpr, WEIGHT_AFTER_CAST: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        # the sum rounded to the residual stream's dtype, as a separate add would leave it, then normalized
        s = (x + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)).to(
            res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_r + cols, s, mask=mask)
        x = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if WEIGHT_AFTER_CAST:  # (Llama's order: normalized, cast to the model dtype, then scaled in it)
        y = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32) * w
    else:  # (Gemma's: scaled by its float32 weight, then cast)
        y = x * rstd * w
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             weight_after_cast: bool = False) -> torch.Tensor:
    """RMSNorm of the rows of x — of residual + x when `residual` is given, which is then updated in place to that
    sum (one pass instead of two: the pre-norm block's residual add fused with its norm). `weight_after_cast`:
    normalize in float32, cast to x's dtype and scale by the weight in it (Llama's order, `layers.RMSNorm`);
    otherwise scale in float32 and cast once (Gemma's, whose weight holds 1 + w in float32)."""
    rows, cols = x.shape
    out = torch.empty_like(x)
    block = triton.next_power_of_2(cols)
    _rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, cols, eps, x.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0),
        HAS_RESIDUAL=residual is not None, WEIGHT_AFTER_CAST=weight_after_cast, BLOCK=block,
        num_warps=4 if block <= 4096 else 8 if block <= 8192 else 16,
    )
    return out


@triton.jit
def _rope_kernel(x_ptr, f_ptr, out_ptr, half, stride_t, stride_h, stride_f, stride_ot, stride_oh,
                 BLOCK: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    m = i < half
    c = tl.load(f_ptr + t * stride_f + 2 * i, mask=m, other=0.0)
    s = tl.load(f_ptr + t * stride_f + 2 * i + 1, mask=m, other=0.0)
    base = x_ptr + t * stride_t + h * stride_h
    x0 = tl.load(base + 2 * i, mask=m, other=0.0).to(tl.float32)
    x1 = tl.load(base + 2 * i + 1, mask=m, other=0.0).to(tl.float32)
    out = out_ptr + t * stride_ot + h * stride_oh
    tl.store(out + 2 * i, (x0 * c - x1 * s).to(out_ptr.dtype.element_ty), mask=m)
    tl.store(out + 2 * i + 1, (x0 * s + x1 * c).to(out_ptr.dtype.element_ty), mask=m)


def rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """`rope.plain_rope` in one launch: the interleaved pairs (2i, 2i+1) of x [T, heads, dim] (any row and head
    strides, unit column stride) times freqs [T, 1, dim/2] complex64 (cos + i sin), in float32, into a new tensor of
    x's dtype."""
    t, heads, dim = x.shape
    f = torch.view_as_real(freqs.reshape(t, dim // 2).contiguous())  # [T, dim/2, (cos, sin)] float32
    out = torch.empty(t, heads, dim, dtype=x.dtype, device=x.device)
    _rope_kernel[(t, heads)](x, f, out, dim // 2, x.stride(0), x.stride(1), f.stride(0), out.stride(0),
                             out.stride(1), BLOCK=triton.next_power_of_2(dim // 2))
    return out


@triton.jit
def _prefill_attention_kernel(
    q_ptr, cache_ptr, tables_ptr, seg_ptr, out_ptr, scale,
    stride_qt, stride_qh, stride_cb, stride_ckv, stride_cs, stride_ch, stride_tb, stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    WINDOW: tl.constexpr, KV_FP8: tl.constexpr = False,
):
    """Causal attention of one segment's new tokens over its whole context (cached prefix, earlier
    chunks and the new tokens), read page by page from the block table. Program = (query tile,
    head, segment); flash-style online softmax, fp32 accumulation. With a WINDOW (> 0) a query at
    position p sees keys p - WINDOW + 1 .. p, and pages before the tile's first visible key are skipped."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    seg = tl.program_id(2)
    q_start = tl.load(seg_ptr + seg * 3)
    q_len = tl.load(seg_ptr + seg * 3 + 1)
    ctx = tl.load(seg_ptr + seg * 3 + 2)
    if tile * BLOCK_M >= q_len:
        return
    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    s_off = tl.arange(0, BLOCK_SIZE)
    m_valid = m < q_len
    q_pos = ctx - q_len + m
    q = tl.load(q_ptr + (q_start + m)[:, None] * stride_qt + h * stride_qh + d[None, :], mask=m_valid[:, None],
                other=0.0)
    kvh = h // GROUP
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    last_pos = tl.minimum(ctx - q_len + (tile + 1) * BLOCK_M, ctx)  # keys past the tile's last query are masked
    first_key = 0
    if WINDOW > 0:
        first_key = tl.maximum(ctx - q_len + tile * BLOCK_M - WINDOW + 1, 0)
    for j in range(first_key // BLOCK_SIZE, tl.cdiv(last_pos, BLOCK_SIZE)):
        blk = tl.load(tables_ptr + seg * stride_tb + j)
        base = cache_ptr + blk * stride_cb + kvh * stride_ch
        k_pos = j * BLOCK_SIZE + s_off
        k_valid = k_pos < ctx
        k = tl.load(base + s_off[:, None] * stride_cs + d[None, :], mask=k_valid[:, None], other=0)
        v = tl.load(base + stride_ckv + s_off[:, None] * stride_cs + d[None, :], mask=k_valid[:, None], other=0)
        if KV_FP8:
            k = e4m3_to_float(k).to(q_ptr.dtype.element_ty)
            v = e4m3_to_float(v).to(q_ptr.dtype.element_ty)
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
        allowed = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
        if WINDOW > 0:
            allowed = allowed & (k_pos[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A windowed row can see no key of this page yet: subtract 0, not -inf (exp(-inf + inf) is nan).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # padding rows past the segment can see no key
    tl.store(out_ptr + (q_start + m)[:, None] * stride_ot + h * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_valid[:, None])


def paged_prefill_attention(q: torch.Tensor, layer_cache: torch.Tensor, block_tables: torch.Tensor,
                            segments: torch.Tensor, scale: float, out: torch.Tensor, max_q_len: int,
                            block_m: int = 64, window: int = 0) -> torch.Tensor:
    """q: [T, heads, dim] (all tokens of the step); segments: [S, 3] int (first row, new tokens, context
    length); block_tables: [S, max_blocks]. Writes each segment's rows of `out` and returns it."""
    heads, dim = q.shape[1], q.shape[2]
    kv_heads, block_size = layer_cache.shape[3], layer_cache.shape[2]
    grid = (triton.cdiv(max_q_len, block_m), heads, segments.shape[0])
    cache, fp8 = bytes_if_fp8(layer_cache)
    _prefill_attention_kernel[grid](
        q, cache, block_tables, segments, out, scale,
        q.stride(0), q.stride(1), layer_cache.stride(0), layer_cache.stride(1), layer_cache.stride(2),
        layer_cache.stride(3), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=heads // kv_heads, BLOCK_M=block_m, BLOCK_SIZE=block_size, HEAD_DIM=dim, WINDOW=window,
        KV_FP8=fp8,
    )
    return out
