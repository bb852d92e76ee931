"""Paged attention: the one seam where device-specific kernels plug in.

The torch path below is the reference (and the CPU path): prefill segments run SDPA
one sequence at a time, decode tokens run in padded batches (grouped by context length) gathered page by page
from the block tables. A GPU kernel replaces `write_kv` / `paged_attention` with the
same arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.model.kernels import cpu_ops, kernels
from engine.model.lora import LoRARows


@dataclass
class PrefillSegment:
    start: int  # first row of this sequence's tokens in the flattened batch
    length: int  # new tokens computed this step
    context_len: int  # tokens in the cache once this step's K/V are written
    blocks: torch.Tensor  # block ids covering `context_len`
    _masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)

    def mask(self, window: int | None) -> torch.Tensor | None:
        """[length, context_len] True where a query may see a key; None for plain causal (SDPA's own).
        Built on first use and shared by every layer with the same window."""
        if window not in self._masks:
            if window is None and self.context_len == self.length:
                self._masks[window] = None
            else:
                dev = self.blocks.device
                q_pos = torch.arange(self.context_len - self.length, self.context_len, device=dev)[:, None]
                k_pos = torch.arange(self.context_len, device=dev)[None, :]
                allowed = k_pos <= q_pos
                if window is not None:
                    allowed &= k_pos > q_pos - window
                self._masks[window] = allowed
        return self._masks[window]


@dataclass
class DecodeBatch:
    start: int  # first row of this group; a group's rows are contiguous, one per sequence
    blocks: torch.Tensor  # [B, max_blocks], padded with block 0
    mask: torch.Tensor  # [B, 1, 1, max_blocks * block_size], True where a key is valid
    context_lens: torch.Tensor | None = None  # [B], for kernels that walk the block table themselves
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask_for(self, window: int | None) -> torch.Tensor:
        """`mask` narrowed to the last `window` keys of each sequence (sliding-window layers)."""
        if window is None:
            return self.mask
        if window not in self._window_masks:
            valid = self.mask.view(self.mask.shape[0], -1)
            ctx = valid.sum(-1, keepdim=True)
            k_pos = torch.arange(valid.shape[1], device=valid.device)[None, :]
            self._window_masks[window] = (valid & (k_pos >= ctx - window)).view(self.mask.shape)
        return self._window_masks[window]


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step's batch, built once and shared by every layer."""

    block_size: int
    k_rows: torch.Tensor  # [T] row of each new token's K in the layer view flattened to [blocks*2*slots]
    v_rows: torch.Tensor  # [T] same for V
    prefills: list[PrefillSegment]
    decodes: list[DecodeBatch]  # decode rows grouped by context length, each group padded to its longest
    # For kernels that take every prefill segment in one launch (built only when they are in use):
    prefill_tables: torch.Tensor | None = None  # [S, max_blocks]
    prefill_info: torch.Tensor | None = None  # [S, 3]: first row, new tokens, context length
    max_prefill_len: int = 0
    lora: LoRARows | None = None  # rows of LoRA adapters (`lora.py`); None: every row is the base model's


def _use_triton(t: torch.Tensor):
    return kernels("triton_ops", t.device.type)


def kernels_enabled(device: torch.device) -> bool:
    return kernels("triton_ops", device.type) is not None


def write_kv(layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
    ops = _use_triton(layer_cache)
    if ops is not None and k.shape[-1] & (k.shape[-1] - 1) == 0:
        two_bs = 2 * meta.block_size
        ops.store_kv(layer_cache, k, v, meta.k_rows // two_bs, meta.k_rows % two_bs)
        return
    flat = layer_cache.view(-1, layer_cache.shape[-2], layer_cache.shape[-1])
    store_rows(flat, meta.k_rows, k)
    store_rows(flat, meta.v_rows, v)


def store_rows(flat: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """flat[rows] = values in the cache's element type (a float16 or e4m3 cache under a float32 model:
    rounded here, to nearest even; e4m3 saturates at +-448: clamped first, since torch's own cast saturates
    in 2.13 but gave NaN past 464 in 2.11, as seen on an H200 host). torch has no index_copy_ for float8:
    its bytes are copied instead."""
    if flat.dtype == torch.float8_e4m3fn:
        values = values.clamp(-448.0, 448.0)
    vals = values.to(flat.dtype)
    if flat.element_size() == 1:
        flat.view(torch.uint8).index_copy_(0, rows, vals.view(torch.uint8))
    else:
        flat.index_copy_(0, rows, vals)


def _gather(layer_cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V pages of `blocks`, in `dtype` (the queries'; a float16 cache is widened here)."""
    # Gathering whole pages from a 2-D view is one row copy per block (the 5-D view takes a
    # generic strided path).
    n = layer_cache.shape[0]
    pages = layer_cache.view(n, -1).index_select(0, blocks.reshape(-1)).view(-1, *layer_cache.shape[1:])
    pages = pages.to(dtype)
    return pages[:, 0], pages[:, 1]


def paged_attention(
    q: torch.Tensor, layer_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None = None
) -> torch.Tensor:
    """q: [T, heads, dim] (roped). Returns [T, heads, dim]. With `window`, a query at position p sees
    keys p - window + 1 .. p only (sliding-window layers; the cache still holds every key)."""
    heads, kv_heads = q.shape[1], layer_cache.shape[-2]
    gqa = heads != kv_heads
    if len(meta.decodes) == 1 and not meta.prefills:  # the steady state: one decode group, no copies
        return _decode(q, layer_cache, meta.decodes[0], scale, gqa, window)
    out = torch.empty_like(q)
    ops = _use_triton(layer_cache)
    if (ops is not None and meta.prefill_info is not None and layer_cache.shape[2] >= 16
            and q.shape[-1] & (q.shape[-1] - 1) == 0):
        ops.paged_prefill_attention(q, layer_cache, meta.prefill_tables, meta.prefill_info, scale, out,
                                    meta.max_prefill_len, window=window or 0)
        prefills = []
    else:
        prefills = meta.prefills
    for seg in prefills:
        # 4-D [1, heads, L, dim] inputs: torch's CPU flash kernel takes them; 3-D ones fall back
        # to the math path (measured 5x slower for a 2k-token prompt).
        qs = q[seg.start : seg.start + seg.length].transpose(0, 1).unsqueeze(0)
        k, v = _gather(layer_cache, seg.blocks, q.dtype)
        k = k.reshape(-1, kv_heads, k.shape[-1])[: seg.context_len].transpose(0, 1).unsqueeze(0)
        v = v.reshape(-1, kv_heads, v.shape[-1])[: seg.context_len].transpose(0, 1).unsqueeze(0)
        mask = seg.mask(window)
        if mask is None:
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            # A cached prefix or an earlier chunk before the new tokens (causal with an offset), or a window.
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask[None, None], scale=scale, enable_gqa=gqa)
        out[seg.start : seg.start + seg.length] = o[0].transpose(0, 1)
    for d in meta.decodes:
        b = d.blocks.shape[0]
        out[d.start : d.start + b] = _decode(q[d.start : d.start + b], layer_cache, d, scale, gqa, window)
    return out


def _decode(q: torch.Tensor, layer_cache: torch.Tensor, d: DecodeBatch, scale: float, gqa: bool,
            window: int | None) -> torch.Tensor:
    """One query per sequence, keys gathered page by page and padded to the longest context."""
    ops = _use_triton(layer_cache)
    if ops is not None and d.context_lens is not None and q.shape[-1] & (q.shape[-1] - 1) == 0:
        return ops.paged_decode_attention(q, layer_cache, d.blocks, d.context_lens, scale, window=window or 0)
    if (d.context_lens is not None and layer_cache.device.type == "cpu" and q.dtype == torch.float32
            and q.stride(-1) == 1 and q.stride(1) == q.shape[-1] and cpu_ops.kv_supported(layer_cache.dtype, q.shape[-1])):
        # Keys read in place through the block table (no gather, no padding): cpu_ops.c.
        return cpu_ops.paged_decode(q, layer_cache, d.blocks, d.context_lens, scale, window or 0)
    b, kv_heads = d.blocks.shape[0], layer_cache.shape[-2]
    k, v = _gather(layer_cache, d.blocks, q.dtype)  # [B*max_blocks, slots, kv_heads, dim]
    k = k.reshape(b, -1, kv_heads, k.shape[-1]).transpose(1, 2)
    v = v.reshape(b, -1, kv_heads, v.shape[-1]).transpose(1, 2)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=d.mask_for(window), scale=scale,
                                       enable_gqa=gqa)
    return o.squeeze(2)
