"""Landing blocks (`kvtransfer.descriptors.landing_entries` + `KVCache.land`): a prefill worker split over
more ranks than the decode worker writes each rank's whole pages into spare decode blocks, and the decode
worker moves them into place. The reference is the row-by-row path (`layer_entries` of the same head
slices, one entry per `[k|v, slot]` row straight into the pages), both applied as byte copies of their
entries: the pages end up with the same bytes, with one entry per run of pages instead of one per row."""

from __future__ import annotations

import ctypes

import pytest
import torch

from common.sampling_params import SamplingParams
from engine.batch.block_manager import BlockManager
from engine.batch.sequence import Sequence
from engine.model.kv_cache import KVCache, KVLayout
from kvtransfer.descriptors import HeadSlice, KVRegion, coalesce, landing_entries, landing_runs, layer_entries

LAYERS, BLOCKS, BS, DIM = 3, 24, 4, 8


def source(heads: int, seed: int, dtype: torch.dtype) -> KVCache:
    kv = KVCache(KVLayout(LAYERS, BLOCKS, BS, heads, DIM, dtype), torch.device("cpu"))
    kv.buffer.copy_(torch.randn(kv.buffer.shape, generator=torch.Generator().manual_seed(seed)).to(dtype))
    return kv


def region(kv: KVCache) -> KVRegion:
    return KVRegion(kv.base_address, LAYERS, BLOCKS, kv.layout.page_bytes)


def apply(entries) -> int:
    n = 0
    for e in entries:
        ctypes.memmove(e.dst, e.src, e.length)
        n += 1
    return n


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("src_heads,dst_heads", [(1, 2), (2, 4), (1, 4), (2, 6)])
def test_landed_pages_moved_into_place_equal_row_writes(src_heads, dst_heads, dtype):
    ranks = dst_heads // src_heads  # prefill ranks feeding one decode rank, each its own heads
    sources = [source(src_heads, r, dtype) for r in range(ranks)]
    src_blocks = [3, 4, 5, 9, 10, 11, 2]
    dst_blocks = [1, 2, 7, 8, 0, 20, 21]
    # Landing blocks in three runs, one of them splitting a run of consecutive source blocks.
    landing = [12, 13, 15, 16, 17, 5, 6]
    layout = sources[0].layout
    rows, hb = layout.planes * BS, DIM * layout.element_size
    ref = KVCache(KVLayout(LAYERS, BLOCKS, BS, dst_heads, DIM, dtype), torch.device("cpu"))
    got = KVCache(ref.layout, torch.device("cpu"))
    runs, to_landing, where = coalesce(src_blocks, dst_blocks), coalesce(src_blocks, landing), landing_runs(landing)
    plain = landed = 0
    for r, kv in enumerate(sources):
        part = HeadSlice(rows, hb, src_heads, dst_heads, 0, r * src_heads, src_heads)
        assert part.landable
        for layer in range(LAYERS):
            plain += apply(layer_entries(region(kv), region(ref), layer, runs, part))
            landed += apply(landing_entries(region(kv), region(got), layer, to_landing, part, where))
    got.land(landing, dst_blocks, [(r * src_heads, src_heads) for r in range(ranks)])
    for d in dst_blocks:
        assert torch.equal(got.buffer[:, d], ref.buffer[:, d]), d
    assert plain == ranks * LAYERS * len(src_blocks) * rows
    assert landed == ranks * LAYERS * len(to_landing)  # one entry per run of pages
    assert len(to_landing) == 5  # (a run breaks where either side does)


def test_only_the_sections_named_move():
    """A section another prefill rank wrote straight into the pages (not landed) is left as it is."""
    kv = source(4, 0, torch.float32)
    before = kv.buffer[:, 1].clone()
    kv.buffer[:, 10:12] = 7.0  # landing blocks for dst 1 and 2
    kv.land([10, 11], [1, 2], [(2, 2)])
    assert torch.equal(kv.buffer[:, 1, :, :, :2], before[:, :, :, :2])
    assert bool((kv.buffer[:, 1, :, :, 2:] == 7.0).all()) and bool((kv.buffer[:, 2, :, :, 2:] == 7.0).all())


def test_a_slice_that_does_not_land_whole_pages_is_refused():
    kv = source(2, 0, torch.float32)
    part = HeadSlice(2 * BS, DIM * 4, 2, 2, 0, 0, 1)  # one of two source heads: strided on both sides
    with pytest.raises(ValueError, match="does not land"):
        landing_entries(region(kv), region(kv), 0, coalesce([1], [2]), part, landing_runs([2]))


def test_landing_blocks_are_held_with_the_request_and_freed_with_it():
    bm = BlockManager(16, BS)
    seq = Sequence("r", list(range(20)), SamplingParams(max_tokens=1))
    assert bm.allocate(seq, 20)  # 5 blocks
    assert bm.take_landing(seq, 1) and len(seq.landing) == 4 and seq.landing_from == 1
    assert not set(seq.landing) & set(seq.block_table)
    assert bm.num_available == 16 - 9
    bm.free_landing(seq)
    assert bm.num_available == 16 - 5 and seq.landing == []
    assert bm.take_landing(seq, 0)
    bm.free_seq(seq)  # (a request stopped before its K/V arrived: the quarantine frees both together)
    assert bm.num_available == 16
    big = Sequence("big", list(range(48)), SamplingParams(max_tokens=1))
    assert bm.allocate(big, 48)  # 12 of 16
    assert not bm.take_landing(big, 0) and big.landing == []  # 12 more are not free: row by row instead
