"""Async scheduling (`LLMEngine.step`, `ModelRunner.launch`): decode step n+1 is queued before step n's
tokens are read, its inputs taking them on the device. Proven on CPU, where "queued" runs at once but
every host-side path is the same: the tokens, texts and finish reasons equal the same engine stepping in
order, through arrivals, aborts, stop strings, stop tokens, lengths, rows that cannot be queued
(sampled, logprobs), a block shortage (preemption) and bucket changes; blocks of a sequence stopped
with a row still queued are freed only once that row is read. With a GPU the same tests run there in
bfloat16 with captured graphs, where the queueing is real."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import Result, drain, make_engine

from common.sampling_params import SamplingParams
from engine.batch.sequence import PENDING
from engine.engine_config import EngineConfig

DEV = dict(device="cuda", dtype="bfloat16", gpu_memory_fraction=0.02) if torch.cuda.is_available() else {}


def _prompts(n: int) -> list[list[int]]:
    return [[(13 * i + 7 * j) % 390 + 3 for j in range(5 + 11 * i)] for i in range(n)]


def _engine(model_dir, on: bool, **kw):
    kw.setdefault("max_num_seqs", 8)
    return make_engine(model_dir, decode_graphs="on", async_scheduling="on" if on else "off", **{**DEV, **kw})


def _steps(engine, script: dict[int, list], max_steps: int = 2000) -> tuple[dict[str, Result], int]:
    """Step the engine; before step k, run each of script[k] (a callable taking the engine). Returns the
    results and how many steps were queued ahead of the last one's read."""
    results: dict[str, Result] = {}
    ahead = 0
    for k in range(max_steps):
        for action in script.get(k, []):
            action(engine)
        if not engine.has_work and k > max(script, default=0):
            return results, ahead
        queued_before = engine._launched
        for o in engine.step():
            r = results.setdefault(o.request_id, Result())
            r.token_ids += o.token_ids
            r.text += o.text
            if o.finished:
                r.finish_reason, r.error = o.finish_reason, o.error
        if queued_before is not None and engine._launched is not None and engine._launched is not queued_before:
            ahead += 1
    raise AssertionError("engine did not finish")


def _add(rid: str, prompt: list[int], **sp):
    sp.setdefault("temperature", 0)
    return lambda e: e.add_request(rid, prompt, SamplingParams(**sp))


def test_queued_decoding_equals_stepping_in_order(tiny_model_dir):
    """Staggered lengths (the batch shrinks through the buckets), EOS honoured, arrivals while streams
    decode, a stop string, a stop token, an abort with a row queued, seeded sampled rows (top-p, top-k,
    min-p: drawn on the device when queued, by `sample` in order), and a row that cannot be queued (one
    asking for logprobs) joining for a while."""
    ps = _prompts(6)
    probe = _engine(tiny_model_dir, False)
    probe.add_request("probe", ps[1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    free = drain(probe)["probe"]
    stop_text, stop_token = free.text[10:14], free.token_ids[17]
    script = {
        0: [*(_add(f"s{i}", p, max_tokens=14 + 5 * i, ignore_eos=True) for i, p in enumerate(ps[:4])),
            _add("temp", ps[2], max_tokens=20, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)],
        2: [_add("unseeded", ps[3], max_tokens=16, temperature=1.0, ignore_eos=True)],
        3: [_add("eos", ps[4], max_tokens=40)],
        4: [_add("topk", ps[3], max_tokens=18, temperature=1.2, top_k=20, min_p=0.01, seed=8, ignore_eos=True)],
        6: [_add("stop", ps[1], max_tokens=30, ignore_eos=True, stop=[stop_text]),
            _add("tok", ps[1], max_tokens=30, ignore_eos=True, stop_token_ids=[stop_token])],
        9: [lambda e: e.abort("s3")],
        14: [_add("hot", ps[5], max_tokens=6, temperature=0.8, seed=3, ignore_eos=True)],
        22: [_add("lp", ps[2], max_tokens=5, ignore_eos=True, logprobs=2)],
        30: [_add("late", ps[0], max_tokens=9, ignore_eos=True)],
    }
    ordered, none_ahead = _steps(_engine(tiny_model_dir, False), script)
    engine = _engine(tiny_model_dir, True)
    queued, ahead = _steps(engine, script)
    assert none_ahead == 0 and ahead >= 15  # (steps queued behind the one before)
    # An abort lands between steps, where the queued engine has handed out one step fewer: what it
    # streamed before is a prefix of what the in-order engine did.
    cut, whole = queued.pop("s3"), ordered.pop("s3")
    # An unseeded sampled row draws from torch's generator, which the two engines use differently.
    free_q, free_o = queued.pop("unseeded"), ordered.pop("unseeded")
    assert len(free_q.token_ids) == len(free_o.token_ids) == 16 and free_q.finish_reason == "length"
    assert 0 < len(cut.token_ids) <= len(whole.token_ids) and cut.token_ids == whole.token_ids[: len(cut.token_ids)]
    assert queued == ordered
    assert queued["stop"].finish_reason == "stop" and queued["stop"].text == free.text[: free.text.index(stop_text)]
    assert queued["tok"].finish_reason == "stop" and queued["tok"].token_ids[-1] == stop_token
    assert len(queued["s0"].token_ids) == 14 and queued["s0"].finish_reason == "length"
    assert engine.blocks.stats().used == 0 and not engine.seqs and engine._launched is None


def test_a_block_shortage_reads_the_queued_step_and_preempts_in_order(tiny_model_dir):
    if DEV:
        pytest.skip("a GPU engine's blocks are sized from its memory")
    page_bytes = 2 * 16 * 2 * 16 * 4 * 2  # (the tiny model's float32 K+V page, 16 tokens)
    kw = dict(kv_cache_gb=11 * page_bytes / 2**30)
    ps = [[(17 * i + j) % 300 + 3 for j in range(20)] for i in range(4)]
    script = {0: [_add(str(i), p, max_tokens=25, ignore_eos=True) for i, p in enumerate(ps)]}
    ordered, _ = _steps(_engine(tiny_model_dir, False, **kw), script)
    engine = _engine(tiny_model_dir, True, **kw)
    queued, ahead = _steps(engine, script)
    assert engine.scheduler.num_preemptions > 0 and ahead > 0
    assert queued == ordered
    assert engine.blocks.stats().used == 0


def test_blocks_of_a_sequence_stopped_with_a_row_queued_are_freed_once_it_is_read(tiny_model_dir):
    engine = _engine(tiny_model_dir, True)
    for i, p in enumerate(_prompts(2)):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    while engine._launched is None or engine.runner.graphs.replays < 3:
        engine.step()
    launched = engine._launched
    seq = engine.seqs["0"]
    assert seq in launched.rows and seq.output_token_ids[-1] == PENDING
    blocks = list(seq.block_table)
    used = engine.blocks.stats().used
    assert engine.abort("0")
    assert engine.blocks.stats().used == used and launched.free_after == [seq]  # still written by the queued row
    engine.step()  # (reads it)
    assert engine.blocks.stats().used < used and not seq.block_table
    assert all(engine.blocks.ref_counts[b] == 0 for b in blocks)
    rest = drain(engine)
    assert "0" not in rest and rest["1"].finish_reason == "length"
    assert engine.blocks.stats().used == 0


def test_a_queued_step_reads_nothing_back_from_the_device(tiny_model_dir):
    """Everything `launch` does after building its host lists — the graph's inputs, the carried tokens,
    the sampling of greedy and sampled rows — runs with no host read of a device tensor (on CPU every
    tensor stands for a device one): on a GPU the host never waits for the step it queues."""
    from engine.batch.graph_runner import HostSyncProbe

    engine = _engine(tiny_model_dir, True)
    for i, p in enumerate(_prompts(3)):
        sp = dict(temperature=0.8, top_p=0.9, seed=i) if i else dict(temperature=0.7)
        engine.add_request(str(i), p, SamplingParams(max_tokens=30, ignore_eos=True, **sp))
    while engine._launched is None:
        engine.step()
    probe = HostSyncProbe("cpu")
    with probe:
        engine.step()  # (queues the next step, then reads this one: the read is the one host read)
    assert probe.seen == ["tolist"]
    drain(engine)


def test_async_scheduling_on_is_refused_where_steps_cannot_be_queued(tiny_model_dir):
    with pytest.raises(ValueError, match="async-scheduling"):
        EngineConfig(model=str(tiny_model_dir), async_scheduling="on", decode_graphs="off").validate()
    with pytest.raises(ValueError, match="async-scheduling"):
        EngineConfig(model=str(tiny_model_dir), async_scheduling="sometimes").validate()
    auto = make_engine(tiny_model_dir, decode_graphs="on")  # (auto: CUDA only, nothing to overlap on a CPU)
    assert not auto.async_scheduling
