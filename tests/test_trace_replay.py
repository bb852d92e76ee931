"""Trace replay (`loadtest/trace_replay.py`): equal block hashes become equal token runs and lengths scale
together; the ideal cache hit matches a hand count; a replay against a router and a worker serves every
request and, one request at a time, caches exactly the ideal."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from procs import address, base_url, start_router, start_worker

from loadtest.trace_replay import Scale, TraceRequest, ideal_cached, read_trace, replay, summarize

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "mooncake_traces"

# Hand-made: request 1 shares blocks 0-1 with request 0; request 2 shares block 0 only; request 3 repeats
# request 0 whole (its last block partial); request 4 shares nothing.
LINES = [
    {"timestamp": 0, "input_length": 1536, "output_length": 100, "hash_ids": [0, 1, 2]},
    {"timestamp": 500, "input_length": 2048, "output_length": 20, "hash_ids": [0, 1, 3, 4]},
    {"timestamp": 900, "input_length": 1000, "output_length": 7, "hash_ids": [0, 5]},
    {"timestamp": 1500, "input_length": 1400, "output_length": 512, "hash_ids": [0, 1, 2]},
    {"timestamp": 2000, "input_length": 600, "output_length": 40, "hash_ids": [6, 7]},
]


@pytest.fixture
def trace(tmp_path) -> Path:
    p = tmp_path / "trace.jsonl"
    p.write_text("".join(json.dumps(d) + "\n" for d in LINES))
    return p


def test_equal_hashes_give_equal_token_runs_and_lengths_scale_together(trace):
    reqs = read_trace(trace)
    scale = Scale(block=16, vocab=400)
    a, b = scale.prompt(reqs[0]), scale.prompt(reqs[1])
    assert a[:32] == b[:32] and a[32:48] != b[32:48]  # blocks 0-1 shared, block 2 vs 3 not
    assert scale.prompt(reqs[3]) == a[: len(scale.prompt(reqs[3]))]
    assert [len(scale.prompt(r)) for r in reqs] == [48, 64, 32, 44, 19]  # input x 16/512, rounded up
    assert [scale.output_tokens(r) for r in reqs] == [3, 1, 1, 16, 1]  # output x 16/512, at least 1
    assert all(3 <= t < 400 for r in reqs for t in scale.prompt(r))
    assert Scale(block=16, vocab=400).block_tokens(12345) == scale.block_tokens(12345)  # a fixed function
    assert [r.at_s for r in read_trace(trace, start_s=0.8, window_s=1.0)] == pytest.approx([0.1, 0.7])


def test_the_ideal_hit_matches_a_hand_count(trace):
    reqs = read_trace(trace)
    # 0: nothing seen. 1: blocks 0, 1 seen -> 32 tokens. 2: block 0 -> 16 (its last token is in block 1).
    # 3: blocks 0-2 seen, but its 44 tokens end in block 2: at most blocks 0-1 -> 32. 4: nothing.
    assert ideal_cached(reqs, Scale(block=16, vocab=400)) == [0, 32, 16, 32, 0]


def test_the_shared_conversation_trace_reads_whole():
    path = SHARED / "conversation_trace.jsonl"
    if not path.exists():
        pytest.skip("../shared/data/mooncake_traces is not beside this checkout")
    reqs = read_trace(path)
    assert len(reqs) == 12_031 and all(len(r.hash_ids) == -(-r.input_length // 512) for r in reqs[:1000])
    # The README's figure for an infinite shared cache over the first 1,000 requests: 21.6% of input tokens.
    scale = Scale(block=512, vocab=1000)
    first = reqs[:1000]
    share = sum(ideal_cached(first, scale)) / sum(r.input_length for r in first)
    assert 0.20 < share < 0.22


async def test_a_replay_through_a_router_caches_exactly_the_ideal_one_at_a_time(trace, tiny_model_dir, tmp_path):
    worker = start_worker("both", tiny_model_dir, tmp_path)
    router = start_router(tiny_model_dir, tmp_path, "--served-model-name", "tiny", "--colocated", address(worker))
    try:
        reqs = read_trace(trace) * 2  # (the second pass finds every prefix cached)
        reqs = [TraceRequest(i * 0.01, r.input_length, r.output_length, r.hash_ids) for i, r in enumerate(reqs)]
        scale = Scale(block=16, vocab=390)
        outs = await replay(base_url(router), "tiny", reqs, scale, speed=1.0,
                            max_inflight=1)
        s = summarize(outs, ttft_slo_s=5.0, itl_slo_s=1.0)
        assert s["errors"] == 0 and s["requests"] == 10
        assert [o.cached_tokens for o in outs] == [o.ideal_cached for o in outs]
        assert [o.prompt_tokens for o in outs] == [len(scale.prompt(r)) for r in reqs]
        assert s["cached_vs_ideal"] == 1.0 and s["slo_attainment"] == 1.0
        await asyncio.sleep(0)
    finally:
        router.stop()
        worker.stop()
