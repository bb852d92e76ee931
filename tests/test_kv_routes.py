"""Writes between workers split over different tensor-parallel sizes (`worker/kv_routes.py`): replayed as
byte copies between real buffers, every decode rank's pages hold exactly the KV heads the engine's own
split gives that rank (`Shard.kv_heads`), each written once — even splits, replicated KV heads, latent
caches — and whole pages when both sides are split alike."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.model.model_config import ModelConfig
from engine.model.parallel import Shard
from kvtransfer.descriptors import HeadSlice, KVRegion, Run, layer_entries
from worker.kv_routes import KVSplit

LAYERS, BLOCKS, BS, DIM, ES = 2, 5, 4, 8, 4  # fp32 values


def config(tiny_model_dir, heads: int, kv_heads: int) -> ModelConfig:
    raw = json.loads((tiny_model_dir / "config.json").read_text())
    return ModelConfig.from_dict({**raw, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
                                  "hidden_size": heads * DIM, "head_dim": DIM})


def model_pages(kv_heads: int, planes: int) -> np.ndarray:
    """Every page of the unsplit model: [layer, block, plane, slot, head, dim] of distinct values."""
    return np.arange(LAYERS * BLOCKS * planes * BS * kv_heads * DIM, dtype=np.float32).reshape(
        LAYERS, BLOCKS, planes, BS, kv_heads, DIM)


def play(split: KVSplit, dst_size: int, full: np.ndarray, runs: list[Run]) -> tuple[list[np.ndarray], int]:
    """The routes' entries as byte copies from each source rank's buffer into zeroed destination buffers."""
    src_heads, dst_heads = split.head_ranges(split.size), split.head_ranges(dst_size)
    srcs = [np.ascontiguousarray(full[:, :, :, :, list(h)]) for h in src_heads]
    dsts = [np.zeros(full.shape[:4] + (len(h), DIM), dtype=np.float32) for h in dst_heads]
    written = np.zeros(sum(d.size for d in dsts), dtype=np.int64)  # every destination value written once
    offsets = np.cumsum([0] + [d.size for d in dsts])
    for route in split.routes_to(dst_size):
        src, dst = srcs[route.src_rank], dsts[route.dst_rank]
        src_region = KVRegion(0, LAYERS, BLOCKS, src[0, 0].nbytes)
        dst_region = KVRegion(0, LAYERS, BLOCKS, dst[0, 0].nbytes)
        assert route.part.check(src_region, dst_region) is None
        sb, db = src.reshape(-1).view(np.uint8), dst.reshape(-1).view(np.uint8)
        for layer in range(LAYERS):
            for e in layer_entries(src_region, dst_region, layer, runs, route.part):
                db[e.dst:e.dst + e.length] = sb[e.src:e.src + e.length]
                first = offsets[route.dst_rank] + e.dst // ES
                written[first:first + e.length // ES] += 1
    return dsts, int(written.max(initial=0))


@pytest.mark.parametrize(("heads", "kv_heads", "src_size", "dst_size"), [
    (4, 2, 2, 1), (4, 2, 1, 2), (4, 2, 2, 2), (4, 2, 4, 1), (4, 2, 1, 4), (4, 2, 4, 2), (4, 2, 2, 4),
    (8, 8, 2, 4), (8, 8, 4, 2), (8, 4, 8, 2), (8, 8, 1, 8), (8, 2, 8, 8),
])
def test_every_decode_rank_gets_exactly_its_heads_once(tiny_model_dir, heads, kv_heads, src_size, dst_size):
    cfg = config(tiny_model_dir, heads, kv_heads)
    split = KVSplit(cfg, src_size, BS, ES)
    full = model_pages(kv_heads, 2)
    runs = [Run(0, 2, 2), Run(3, 0, 1)]  # source blocks 0,1 -> 2,3 and 3 -> 0
    dsts, most = play(split, dst_size, full, runs)
    assert most == 1
    for rank, (dst, held) in enumerate(zip(dsts, split.head_ranges(dst_size), strict=True)):
        assert list(held) == list(Shard(rank, dst_size).kv_heads(heads, kv_heads))
        want = full[:, :, :, :, list(held)]
        assert np.array_equal(dst[:, 2:4], want[:, 0:2]) and np.array_equal(dst[:, 0], want[:, 3])
        assert not dst[:, 1].any() and not dst[:, 4].any()  # blocks outside the runs untouched


@pytest.mark.parametrize(("src_size", "dst_size"), [(1, 1), (2, 2), (4, 4)])
def test_alike_splits_pair_rank_with_rank_in_whole_pages(tiny_model_dir, src_size, dst_size):
    split = KVSplit(config(tiny_model_dir, 8, 4), src_size, BS, ES)
    routes = split.routes_to(dst_size)
    assert [(r.src_rank, r.dst_rank) for r in routes] == [(r, r) for r in range(src_size)]
    assert all(r.part.whole for r in routes)
    region = KVRegion(0, LAYERS, BLOCKS, split.page_bytes(src_size))
    # whole pages coalesce: one entry per run and layer, as before head slices existed
    assert len(layer_entries(region, region, 1, [Run(0, 1, 3)], routes[0].part)) == 1


def test_a_latent_cache_is_sent_whole_from_one_rank_per_decode_rank(tmp_path):
    from hf_models import make_hf_model

    cfg = ModelConfig.from_dir(make_hf_model("deepseek_v3", tmp_path / "m").path)
    split = KVSplit(cfg, 2, BS, ES)
    assert split.page_bytes(1) == split.page_bytes(2) == split.page_bytes(4)  # replicated, not split
    for dst_size in (1, 2, 4):
        routes = split.routes_to(dst_size)
        assert sorted(r.dst_rank for r in routes) == list(range(dst_size))  # each decode rank once
        assert all(r.part.whole for r in routes)
        assert [r.src_rank for r in routes] == [d % 2 for d in range(dst_size)]


def test_a_slice_that_does_not_fit_the_pages_says_why():
    part = HeadSlice(rows=8, head_bytes=32, src_heads=2, dst_heads=1, src_first=1, dst_first=0, count=1)
    ok_src, ok_dst = KVRegion(0, 2, 4, 8 * 2 * 32), KVRegion(0, 2, 4, 8 * 32)
    assert part.check(ok_src, ok_dst) is None
    assert "destination page size differs" in (part.check(ok_src, KVRegion(0, 2, 4, 8 * 16)) or "")
    assert "layer count differs" in (part.check(ok_src, KVRegion(0, 3, 4, 8 * 32)) or "")
