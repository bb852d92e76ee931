"""Block descriptors and the coalescing that turns block pairs into few, large writes.

A KV region is the engine's one registered buffer, addressed page by page (a page is
one block's K and V in one layer; see `engine/model/kv_cache.py`). Pairs of (source block,
destination block) that are consecutive on *both* sides merge into one run, and each
run is one write entry per layer.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVRegion:
    base_address: int
    num_layers: int
    num_blocks: int
    page_bytes: int

    @property
    def nbytes(self) -> int:
        return self.num_layers * self.num_blocks * self.page_bytes

    def page_address(self, layer: int, block: int) -> int:
        if not (0 <= layer < self.num_layers and 0 <= block < self.num_blocks):
            raise IndexError(f"page (layer={layer}, block={block}) outside {self.num_layers}x{self.num_blocks}")
        return self.base_address + (layer * self.num_blocks + block) * self.page_bytes

    def compatible_with(self, other: KVRegion) -> str | None:
        """Why K/V pages cannot be copied between the two regions, or None if they can."""
        if self.num_layers != other.num_layers:
            return f"layer count differs ({self.num_layers} vs {other.num_layers})"
        if self.page_bytes != other.page_bytes:
            return f"page size differs ({self.page_bytes} vs {other.page_bytes} bytes: model, dtype or block size)"
        return None


@dataclass(frozen=True)
class Run:
    src_block: int
    dst_block: int
    count: int


@dataclass(frozen=True)
class WriteEntry:
    src: int
    dst: int
    length: int


def coalesce(src_blocks: list[int], dst_blocks: list[int]) -> list[Run]:
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source blocks for {len(dst_blocks)} destinations")
    runs: list[Run] = []
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        if runs and runs[-1].src_block + runs[-1].count == s and runs[-1].dst_block + runs[-1].count == d:
            last = runs[-1]
            runs[-1] = Run(last.src_block, last.dst_block, last.count + 1)
        else:
            runs.append(Run(s, d, 1))
    return runs


def layer_entries(src: KVRegion, dst: KVRegion, layer: int, runs: list[Run]) -> list[WriteEntry]:
    return [
        WriteEntry(src.page_address(layer, r.src_block), dst.page_address(layer, r.dst_block), r.count * src.page_bytes)
        for r in runs
    ]
