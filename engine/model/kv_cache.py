"""The paged KV cache: one contiguous buffer for every layer's K and V.

Layout `[layer, block, k|v, slot, kv_head, head_dim]`; for multi-head latent attention
(DeepSeek-V3) one plane instead of two, `[layer, block, 1, slot, 1, kv_lora_rank + rope_dim]`:
each token's latent and RoPE key, from which attention derives every head's K and V. One allocation means the
transfer engine registers it once; putting K and V of a block side by side makes a
block's KV for one layer a single *page*, and consecutive block ids of one layer are
consecutive pages, so a request's blocks coalesce into few, large transfer entries.

Byte addressing (what `kvtransfer/` uses; stable across processes with the same
model, dtype and block size):

    page_offset(layer, block) = (layer * num_blocks + block) * page_bytes
    pages `block .. block+n-1` of one layer are the byte range
    [page_offset(layer, block), page_offset(layer, block) + n * page_bytes)
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import torch

from engine.model.model_config import ModelConfig


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    planes: int = 2  # K and V side by side; 1 for a latent cache

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, self.num_blocks, self.planes, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def page_bytes(self) -> int:
        """Bytes of one block's K and V (or latents) in one layer."""
        return self.planes * self.block_size * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def total_bytes(self) -> int:
        return self.num_layers * self.num_blocks * self.page_bytes

    def page_offset(self, layer: int, block: int) -> int:
        if not (0 <= layer < self.num_layers and 0 <= block < self.num_blocks):
            raise IndexError(f"page (layer={layer}, block={block}) outside {self.num_layers}x{self.num_blocks}")
        return (layer * self.num_blocks + block) * self.page_bytes

    @classmethod
    def for_budget(
        cls, cfg: ModelConfig, budget_bytes: int, block_size: int, dtype: torch.dtype,
        entry: tuple[int, int, int] | None = None, layers: int | None = None,
    ) -> KVLayout:
        """`entry`: (planes, heads, dim) per token and layer when not the whole model's (a tensor-parallel
        rank holds its KV heads only); `layers`: how many layers the budget holds (a pipeline stage's)."""
        planes, heads, dim = entry or cfg.kv_entry
        n = layers or cfg.num_layers
        probe = cls(n, 1, block_size, heads, dim, dtype, planes)
        num_blocks = budget_bytes // (probe.page_bytes * n)
        if num_blocks < 2:
            raise ValueError(
                f"KV cache budget of {budget_bytes / 2**20:.1f} MiB holds fewer than 2 blocks "
                f"({probe.page_bytes * n / 2**20:.2f} MiB each); raise --kv-cache-gb"
            )
        return cls(n, num_blocks, block_size, heads, dim, dtype, planes)


class KVCache:
    def __init__(self, layout: KVLayout, device: torch.device):
        self.layout = layout
        shape = layout.shape
        self._mapping: mmap.mmap | None = None
        if device.type == "cpu":
            # Anonymous memory: the kernel hands out zeroed pages on first touch, so start-up does not
            # write the whole budget (measured 0.28 s and 1 GiB resident for --kv-cache-gb 1) and
            # the process's RSS grows with the blocks actually used.
            numel = 1
            for d in shape:
                numel *= d
            self._mapping = mmap.mmap(-1, numel * layout.element_size)
            self.buffer = torch.frombuffer(self._mapping, dtype=layout.dtype).view(shape)
        else:
            self.buffer = torch.zeros(shape, dtype=layout.dtype, device=device)

    def layer(self, i: int) -> torch.Tensor:
        """`[num_blocks, planes, block_size, kv_heads, head_dim]` view of layer `i`."""
        return self.buffer[i]

    @property
    def base_address(self) -> int:
        return self.buffer.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.layout.total_bytes

    def land(self, landing: list[int], dst: list[int], sections: list[tuple[int, int]]) -> None:
        """Move K/V a prefill worker wrote into landing blocks as whole pages of its own (it holds fewer
        heads per page than this cache) into their pages: `landing[i]`'s into `dst[i]`, for each section
        `(first head, heads)`. The landing layout (`kvtransfer.descriptors.landing_entries`): a run of `n`
        consecutive landing blocks is, in each layer, `n` pages of bytes holding each section's
        `[n, k|v, slot, heads, dim]` at `n * first` heads' worth of pages from its start."""
        L = self.layout
        head_page = L.planes * L.block_size * L.head_dim  # one head of one page, in elements
        flat = self.buffer.view(L.num_layers, L.num_blocks, L.planes * L.block_size * L.num_kv_heads * L.head_dim)
        i = 0
        while i < len(landing):
            j = i + 1
            while j < len(landing) and landing[j] == landing[j - 1] + 1:
                j += 1
            n, first = j - i, landing[i]
            run = flat[:, first : first + n].reshape(L.num_layers, -1)
            index = torch.tensor(dst[i:j], dtype=torch.long, device=self.buffer.device)
            for h, count in sections:
                part = run[:, n * h * head_page : n * (h + count) * head_page]
                self.buffer[:, index, :, :, h : h + count] = part.view(L.num_layers, n, L.planes, L.block_size, count,
                                                                      L.head_dim)
            i = j
