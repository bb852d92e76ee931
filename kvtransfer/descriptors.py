"""Block descriptors and the coalescing that turns block pairs into few, large writes.

A KV region is the engine's one registered buffer, addressed page by page (a page is
one block's K and V in one layer; see `engine/model/kv_cache.py`). Pairs of (source block,
destination block) that are consecutive on *both* sides merge into one run, and each
run is one write entry per layer.

Workers split over different numbers of tensor-parallel ranks hold different KV heads per page: a
`HeadSlice` moves some heads of every row of a page (a page is rows of heads: `[k|v, slot]` rows of
`heads x head_dim` values), one entry per row, since a head subset of a page is strided. Two ways round
that: whole destination rows from strided source rows are gathered into staged pages by the sender
(`worker/kv/staging.py`); whole source rows into strided destination rows (a prefill worker split over
more ranks than the decode worker) land in spare destination blocks as whole pages (`landing_entries`),
and the decode worker moves them into place (`KVCache.land`).
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


@dataclass(frozen=True)
class HeadSlice:
    """`count` heads of every row of a page: from head `src_first` of source rows holding `src_heads`
    heads into head `dst_first` of destination rows holding `dst_heads`; `rows` rows per page (planes x
    block size) of `head_bytes` per head."""

    rows: int
    head_bytes: int
    src_heads: int
    dst_heads: int
    src_first: int
    dst_first: int
    count: int

    @property
    def whole(self) -> bool:
        """Every head of both pages: whole pages move (and consecutive pages coalesce)."""
        return self.count == self.src_heads == self.dst_heads

    @property
    def landable(self) -> bool:
        """Whole source rows into strided destination rows: sent as whole pages into landing blocks."""
        return self.count == self.src_heads < self.dst_heads

    def check(self, src: KVRegion, dst: KVRegion) -> str | None:
        """Why this slice does not fit the two regions' pages, or None (which layers go where is the
        routes' business: pipeline stages hold different layers)."""
        for name, region, heads, first in (("source", src, self.src_heads, self.src_first),
                                           ("destination", dst, self.dst_heads, self.dst_first)):
            if region.page_bytes != self.rows * heads * self.head_bytes:
                return (f"{name} page size differs ({region.page_bytes} bytes, expected {self.rows} rows of "
                        f"{heads} heads x {self.head_bytes} bytes: model, dtype or block size)")
            if not (0 <= first and first + self.count <= heads):
                return f"{name} heads {first}..{first + self.count - 1} outside the page's {heads}"
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


def landing_runs(blocks: list[int]) -> dict[int, tuple[int, int]]:
    """Each landing block's run: (first block, blocks) of the maximal run of consecutive ids, in list
    order, that holds it. A run is one byte range per layer, laid out section by section."""
    out: dict[int, tuple[int, int]] = {}
    i = 0
    while i < len(blocks):
        j = i + 1
        while j < len(blocks) and blocks[j] == blocks[j - 1] + 1:
            j += 1
        for b in blocks[i:j]:
            out[b] = (blocks[i], j - i)
        i = j
    return out


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


def layer_entries(src: KVRegion, dst: KVRegion, layer: int, runs: list[Run],
                  part: HeadSlice | None = None, dst_layer: int | None = None) -> list[WriteEntry]:
    """One layer's writes of `runs`: one entry per run of whole pages, or (a head slice) one per row.
    `dst_layer`: the layer's index in the destination's region when not `layer` (pipeline stages)."""
    dl = layer if dst_layer is None else dst_layer
    if part is None or part.whole:
        return [
            WriteEntry(src.page_address(layer, r.src_block), dst.page_address(dl, r.dst_block),
                       r.count * src.page_bytes)
            for r in runs
        ]
    hb, n = part.head_bytes, part.count * part.head_bytes
    src_row, dst_row = part.src_heads * hb, part.dst_heads * hb
    out: list[WriteEntry] = []
    for r in runs:
        for i in range(r.count):
            s0 = src.page_address(layer, r.src_block + i) + part.src_first * hb
            d0 = dst.page_address(dl, r.dst_block + i) + part.dst_first * hb
            out.extend(WriteEntry(s0 + row * src_row, d0 + row * dst_row, n) for row in range(part.rows))
    return out


def landing_entries(src: KVRegion, dst: KVRegion, layer: int, runs: list[Run], part: HeadSlice,
                    landing: dict[int, tuple[int, int]], dst_layer: int | None = None) -> list[WriteEntry]:
    """One layer's writes of whole source pages into landing blocks (`runs`' destinations; `landing`:
    `landing_runs` of every landing block of the request). A landing run of `n` blocks in one layer is
    `n` pages of bytes holding, for each destination head from `part.dst_first`, its section: the `n`
    blocks' `[k|v, slot, heads, dim]` of those heads, block after block. A run of pages consecutive on
    both sides (`coalesce` never crosses a landing run) is one entry."""
    if not part.landable:
        raise ValueError(f"{part} does not land whole source pages")
    head_page = part.rows * part.head_bytes  # one head's bytes of one page
    dl = layer if dst_layer is None else dst_layer
    out: list[WriteEntry] = []
    for r in runs:
        first, n = landing[r.dst_block]
        at = dst.page_address(dl, first) + n * part.dst_first * head_page + (r.dst_block - first) * src.page_bytes
        out.append(WriteEntry(src.page_address(layer, r.src_block), at, r.count * src.page_bytes))
    return out
