"""Writes between workers split over different tensor-parallel sizes (`worker/kv/routes.py`): replayed as
byte copies between real buffers, every decode rank's pages hold exactly the KV heads the engine's own
split gives that rank (`Shard.kv_heads`), each written once — even splits, replicated KV heads, latent
caches — and whole pages when both sides are split alike."""

from __future__ import annotations

import json
from itertools import pairwise

import numpy as np
import pytest

from engine.model.model_config import ModelConfig
from engine.model.parallel import Shard
from kvtransfer.descriptors import HeadSlice, KVRegion, Run, layer_entries
from worker.kv.routes import KVSplit, stage_layout

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
    assert part.check(ok_src, KVRegion(0, 3, 4, 8 * 32)) is None  # (layers: `stage_layout`, the routes)


def test_stage_layouts_are_read_from_the_ranks_layers_and_refused_when_they_are_not_stages():
    assert stage_layout([range(0, 6)] * 3, 6) == (3, [range(0, 6)])
    assert stage_layout([range(0, 2), range(0, 2), range(2, 6), range(2, 6)], 6) == (2, [range(0, 2), range(2, 6)])
    assert stage_layout([range(0, 2), range(2, 4), range(4, 6)], 6) == (1, [range(0, 2), range(2, 4), range(4, 6)])
    for bad, n in [([range(0, 4)], 6),  # another model (layer count)
                   ([range(0, 2), range(3, 6)], 6),  # a gap
                   ([range(0, 2), range(0, 2), range(2, 6)], 6),  # a stage short of a rank
                   ([range(0, 2), range(2, 6), range(0, 2), range(2, 6)], 6)]:  # not stage-major
        with pytest.raises(ValueError, match="6 layers"):
            stage_layout(bad, n)


@pytest.mark.parametrize(("src", "dst"), [
    # (tensor-parallel size, stage boundaries) of the prefill worker, then of the decode worker
    ((1, [0, 2, 5]), (1, [0, 5])), ((1, [0, 5]), (1, [0, 3, 5])), ((1, [0, 2, 5]), (1, [0, 3, 5])),
    ((2, [0, 1, 5]), (1, [0, 4, 5])), ((1, [0, 3, 5]), (2, [0, 2, 5])), ((2, [0, 2, 4, 5]), (2, [0, 3, 5])),
    ((2, [0, 5]), (1, [0, 1, 2, 5])),
])
def test_pipeline_stages_route_every_layer_of_every_head_once(tiny_model_dir, src, dst):
    """Split over stages as well: each rank holds its stage's layers only (local layer 0 = the stage's
    first); replayed as byte copies, every decode rank ends with exactly its stage's layers of its heads."""
    layers = 5
    raw = json.loads((tiny_model_dir / "config.json").read_text())
    cfg = ModelConfig.from_dict({**raw, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 4 * DIM,
                                 "head_dim": DIM, "num_hidden_layers": layers})
    (src_tp, src_cuts), (dst_tp, dst_cuts) = src, dst
    src_stages = [range(a, b) for a, b in pairwise(src_cuts)]
    dst_stages = [range(a, b) for a, b in pairwise(dst_cuts)]
    split = KVSplit(cfg, src_tp, BS, ES, tuple(src_stages) if len(src_stages) > 1 else ())
    full = np.arange(layers * BLOCKS * 2 * BS * 2 * DIM, dtype=np.float32).reshape(layers, BLOCKS, 2, BS, 2, DIM)

    def rank_pages(stages: list[range], tp: int, empty: bool) -> list[np.ndarray]:
        out = []
        for st in stages:
            for heads in split.head_ranges(tp):
                part = np.ascontiguousarray(full[st.start:st.stop][:, :, :, :, list(heads)])
                out.append(np.zeros_like(part) if empty else part)
        return out

    srcs, dsts = rank_pages(src_stages, src_tp, False), rank_pages(dst_stages, dst_tp, True)
    written = [np.zeros(d.size, dtype=np.int64) for d in dsts]
    runs = [Run(0, 2, 2), Run(3, 0, 1)]
    routes = split.routes_to(dst_tp, dst_stages if len(dst_stages) > 1 else None)
    assert stage_layout([st for st in dst_stages for _ in range(dst_tp)], layers) == (dst_tp, dst_stages)
    for route in routes:
        s, d = srcs[route.src_rank], dsts[route.dst_rank]
        sr, dr = KVRegion(0, len(s), BLOCKS, s[0, 0].nbytes), KVRegion(0, len(d), BLOCKS, d[0, 0].nbytes)
        sb, db = s.reshape(-1).view(np.uint8), d.reshape(-1).view(np.uint8)
        for layer in (route.layers if route.layers is not None else range(len(s))):
            for e in layer_entries(sr, dr, layer, runs, route.part, layer + route.layer_shift):
                db[e.dst:e.dst + e.length] = sb[e.src:e.src + e.length]
                written[route.dst_rank][e.dst // ES:(e.dst + e.length) // ES] += 1
    want = rank_pages(dst_stages, dst_tp, False)
    for d, w, count in zip(dsts, want, written, strict=True):
        assert np.array_equal(d[:, 2:4], w[:, 0:2]) and np.array_equal(d[:, 0], w[:, 3])
        assert not d[:, 1].any() and not d[:, 4].any()
        assert count.max() == 1
