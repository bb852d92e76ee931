"""Staged store I/O (`worker/kv/tier_ranks.StorePages`: a batch of blocks gathered block-major into a
registered buffer, one range per block) against the plain in-place path (one range per layer page), on a
real mooncake_master: an object published one way is read back the other way into the same bytes, batches
larger than the buffer included, and a fetch counts only the blocks that arrived."""

from __future__ import annotations

import pytest
import torch
from procs import start_kv_master

from engine.model.kv_cache import KVCache, KVLayout
from kvtransfer.store import KVStore, StoreConfig
from worker.kv.tier_ranks import StorePages

LAYERS, BLOCKS = 5, 24


def cache(seed: int) -> KVCache:
    kv = KVCache(KVLayout(LAYERS, BLOCKS, 4, 2, 8, torch.float32), torch.device("cpu"))
    kv.buffer.copy_(torch.randn(kv.buffer.shape, generator=torch.Generator().manual_seed(seed)))
    return kv


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    m = start_kv_master(tmp_path_factory.mktemp("store-staging"))
    yield f"127.0.0.1:{m.ports['rpc']}"
    m.stop()


def pages(master: str, kv: KVCache, staged_blocks: int) -> StorePages:
    store = KVStore(StoreConfig(master, lend_bytes=64 << 20))
    assert store.ready()
    block_bytes = LAYERS * kv.layout.page_bytes
    return StorePages(store, kv, staging_bytes=staged_blocks * block_bytes)


@pytest.mark.parametrize("publisher,reader", [(5, 0), (0, 5), (5, 3), (0, 0)])
def test_staged_and_in_place_objects_are_the_same_bytes(master, publisher, reader):
    """`publisher` / `reader`: blocks per staged batch (0: in place). 9 blocks: batches of 5 then 4."""
    src, dst = cache(1), cache(2)
    a, b = pages(master, src, publisher), pages(master, dst, reader)
    assert (a.capacity, b.capacity) == (publisher, reader)
    keys = [f"staging-test/{publisher}-{reader}/{i}" for i in range(9)]
    src_blocks, dst_blocks = [3, 4, 5, 9, 0, 17, 22, 23, 11], [1, 2, 3, 4, 5, 6, 7, 8, 20]
    assert a.put(keys, src_blocks) == 9
    untouched = dst.buffer[:, [0, 9, 10]].clone()
    assert b.get(keys, dst_blocks) == 9
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        assert torch.equal(dst.buffer[:, d], src.buffer[:, s]), (s, d)
    assert torch.equal(dst.buffer[:, [0, 9, 10]], untouched)  # nothing else written
    # A key the store lacks ends the run: only the leading blocks that arrived count.
    assert b.get([keys[0], "staging-test/missing", keys[2]], [12, 13, 14]) == 1
    for p in (a, b):
        p.store.close()
