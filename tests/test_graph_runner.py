"""Decode steps from per-bucket static buffers (the CUDA-graph runner), proven on CPU where a
"replay" is the same padded forward: outputs equal eager decoding across bucket boundaries and
preemption, buffers stay put, oversized batches run eagerly, padding never touches real blocks."""

from __future__ import annotations

import pytest
from engine_helpers import drain, make_engine
from reference import Reference

from common.sampling_params import SamplingParams
from engine.batch.graph_runner import DecodeGraphs, buckets_for

GREEDY = dict(temperature=0, ignore_eos=True)


def _prompts(n: int) -> list[list[int]]:
    return [[(13 * i + 7 * j) % 390 + 3 for j in range(5 + 11 * i)] for i in range(n)]


def _run(engine, prompts, max_tokens=12, staggered=False):
    """`staggered`: request i stops after max_tokens + 4 i tokens, so the running batch shrinks."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=max_tokens + (4 * i if staggered else 0), **GREEDY))
    return {k: v.token_ids for k, v in drain(engine).items()}


def test_buckets():
    assert buckets_for(1) == [1]
    assert buckets_for(6) == [1, 2, 4, 6]
    assert buckets_for(16) == [1, 2, 4, 8, 16]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7])
def test_padded_bucket_decoding_equals_eager(tiny_model_dir, n):
    eager = _run(make_engine(tiny_model_dir, decode_graphs="off", max_num_seqs=8), _prompts(n), staggered=True)
    engine = make_engine(tiny_model_dir, decode_graphs="on", max_num_seqs=8)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.buckets == [1, 2, 4, 8]
    before = {b: (s.input_ids.data_ptr(), s.tables.data_ptr(), s.k_rows.data_ptr()) for b, s in graphs.static.items()}
    assert engine.blocks.num_blocks == engine.kv.layout.num_blocks - 1  # the scratch block is never handed out
    out = _run(engine, _prompts(n), staggered=True)
    assert out == eager
    assert graphs.replays > 0
    after = {b: (s.input_ids.data_ptr(), s.tables.data_ptr(), s.k_rows.data_ptr()) for b, s in graphs.static.items()}
    assert after == before  # static buffers, never reallocated
    hidden = {b: s.hidden.data_ptr() for b, s in graphs.static.items() if s.hidden is not None}
    _run(engine, _prompts(n))
    assert {b: s.hidden.data_ptr() for b, s in graphs.static.items() if s.hidden is not None} == hidden
    assert engine.blocks.stats().used == 0


def test_batches_above_the_largest_bucket_run_eagerly(tiny_model_dir):
    engine = make_engine(tiny_model_dir, decode_graphs="on", max_num_seqs=6)
    kv, model = engine.kv, engine.model
    small = DecodeGraphs(lambda ids, pos, meta: model(ids, pos, kv, meta), 2, engine.runner.graphs.static[1].tables.shape[1],
                         engine.config.block_size, engine.blocks.num_blocks, engine.device)
    engine.runner.graphs = small
    seen = []
    original = small.run
    small.run = lambda *a: (seen.append(len(a[0])), original(*a))[1]
    out = _run(engine, _prompts(5), staggered=True)
    assert out == _run(make_engine(tiny_model_dir, decode_graphs="off", max_num_seqs=6), _prompts(5), staggered=True)
    assert seen and max(seen) == 2  # 3-5 running: eager; the tail of 1-2: replayed


def test_preemption_with_graphs_keeps_output_exact(tiny_model_dir):
    page_bytes = 2 * 16 * 2 * 16 * 4 * 2
    engine = make_engine(tiny_model_dir, kv_cache_gb=11 * page_bytes / 2**30, decode_graphs="on")
    assert engine.blocks.num_blocks == 10  # 11 blocks, one kept as scratch
    ps = [[(17 * i + j) % 300 + 3 for j in range(20)] for i in range(4)]
    out = _run(engine, ps, max_tokens=25)
    assert engine.scheduler.num_preemptions > 0 and engine.runner.graphs.replays > 0
    ref = Reference(tiny_model_dir)
    for i, p in enumerate(ps):
        assert out[str(i)] == ref.greedy(p, 25)
