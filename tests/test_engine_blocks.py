"""KV blocks: tenant isolation, accounting after completion and abort, addressing."""

from __future__ import annotations

import torch
from engine_helpers import drain, make_engine

from common.sampling_params import SamplingParams
from engine.batch.block_manager import BlockManager
from engine.batch.sequence import Sequence
from engine.model.kv_cache import KVLayout


def _seq(rid: str, tokens: list[int], tenant: str) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(), tenant=tenant)


def test_prefix_blocks_never_cross_tenants():
    bm = BlockManager(num_blocks=32, block_size=4)
    prompt = list(range(20))
    a = _seq("a", prompt, "tenant-a")
    assert bm.allocate(a, len(prompt))
    a.num_computed_tokens = len(prompt)
    bm.register_computed(a)
    b = _seq("b", prompt, "tenant-b")
    assert bm.allocate(b, len(prompt))
    assert b.num_cached_tokens == 0
    assert not set(a.block_table) & set(b.block_table)
    a2 = _seq("a2", prompt, "tenant-a")
    assert bm.allocate(a2, len(prompt))
    assert a2.num_cached_tokens == 16  # 4 full blocks, last one recomputed
    assert a2.block_table[:4] == a.block_table[:4]


def test_cached_blocks_are_reclaimed_lru_on_demand():
    bm = BlockManager(num_blocks=4, block_size=4)
    s = _seq("s", list(range(16)), "")
    assert bm.allocate(s, 16)
    s.num_computed_tokens = 16
    bm.register_computed(s)
    bm.free_seq(s)
    assert bm.stats().cached == 4 and bm.stats().free == 0
    t = _seq("t", list(range(100, 116)), "")
    assert bm.allocate(t, 16)  # every cached block is evicted to make room
    assert bm.stats().used == 4 and not bm.hash_to_block


def test_blocks_return_after_completion_and_abort(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    total = engine.blocks.num_blocks
    for i in range(4):
        engine.add_request(f"done{i}", list(range(3 + i, 60 + i)), SamplingParams(temperature=0, max_tokens=5))
    engine.add_request("aborted", list(range(3, 90)), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.blocks.stats().used > 0
    assert engine.abort("aborted")
    drain(engine)
    s = engine.blocks.stats()
    assert s.used == 0 and s.free + s.cached == total
    assert not engine.seqs


def test_request_that_can_never_fit_is_rejected(tiny_model_dir):
    import pytest

    from common.errors import RequestError

    engine = make_engine(tiny_model_dir, kv_cache_gb=8 * 8192 / 2**30)
    with pytest.raises(RequestError, match="KV blocks"):
        engine.add_request("big", list(range(3, 100)), SamplingParams(max_tokens=200))
    with pytest.raises(RequestError, match="context"):
        engine.add_request("long", [5] * 2000, SamplingParams(max_tokens=1))
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(RequestError, match="token ids"):
        engine.add_request("oov", [10**6], SamplingParams())


def test_page_addressing_matches_the_buffer():
    layout = KVLayout(num_layers=3, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    buf = torch.arange(3 * 5 * 2 * 4 * 2 * 8, dtype=torch.float32).view(3, 5, 2, 4, 2, 8)
    base = buf.data_ptr()
    for layer, block in [(0, 0), (1, 3), (2, 4)]:
        assert buf[layer, block].data_ptr() - base == layout.page_offset(layer, block)
    assert layout.page_bytes == buf[0, 0].numel() * 4
    assert layout.page_offset(1, 3) + 2 * layout.page_bytes == layout.page_offset(2, 0)


def test_free_extents_hand_out_long_runs_and_merge_returns():
    from engine.batch.free_extents import FreeExtents

    f = FreeExtents(10)
    a = f.take(3)
    b = f.take(4)
    assert a == [0, 1, 2] and b == [3, 4, 5, 6] and len(f) == 3
    for blk in (1, 5, 4, 0):  # returns merge with their neighbours: runs [0, 2) and [4, 6)
        f.add(blk)
    assert f.take(3) == [7, 8, 9]  # the longest run first
    assert f.take_after(3) and not f.take_after(2)  # 4 was free and is now taken; 3 is in use
    assert sorted(f.take(3)) == [0, 1, 5] and len(f) == 0


def test_allocation_stays_contiguous_under_churn():
    """Requests come and go and their blocks stay in the prefix cache (so new requests mostly get
    evicted cached blocks): a request's blocks should still come in very few runs."""
    import random

    from kvtransfer.descriptors import coalesce

    rng = random.Random(0)
    bm = BlockManager(num_blocks=2000, block_size=16)
    live: list[Sequence] = []
    runs = []

    def finish(s: Sequence) -> None:
        s.num_computed_tokens = s.num_tokens
        bm.register_computed(s)
        bm.free_seq(s)

    for i in range(1500):
        n = rng.choice([40, 300, 1500])
        s = _seq(f"s{i}", [rng.randrange(300) for _ in range(n)], "t")
        while not bm.allocate(s, n):
            finish(live.pop(rng.randrange(len(live))))
        live.append(s)
        if n == 1500:
            runs.append(len(coalesce(s.block_table, list(range(len(s.block_table))))))
        if len(live) > 8:
            finish(live.pop(rng.randrange(len(live))))
    assert len(bm.lru) > 1000  # most free capacity is cached blocks, as in a long-running worker
    assert sum(runs) / len(runs) < 4, sum(runs) / len(runs)  # a plain LRU/stack allocator: ~45
