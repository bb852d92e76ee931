"""Greedy output of the paged, batched engine equals a plain full-recompute forward pass."""

from __future__ import annotations

import pytest
from engine_helpers import drain, make_engine
from reference import Reference

from common.sampling_params import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    return Reference(tiny_model_dir)


def prompts(n: int, base: int = 7) -> list[list[int]]:
    return [[(base * i + 13 * j) % 300 + 3 for j in range(5 + 11 * i)] for i in range(n)]


def test_batch_of_mixed_lengths_equals_reference(tiny_model_dir, ref):
    engine = make_engine(tiny_model_dir)
    ps = prompts(5)
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=12, **GREEDY))
    out = drain(engine)
    for i, p in enumerate(ps):
        assert out[f"r{i}"].token_ids == ref.greedy(p, 12), f"request {i} (prompt {len(p)} tokens)"


def test_chunked_prefill_equals_reference(tiny_model_dir, ref):
    # A 16-token step budget splits every prompt into several chunks that interleave with decodes.
    engine = make_engine(tiny_model_dir, max_num_seqs=4, max_num_batched_tokens=16)
    ps = [list(range(3, 80)), list(range(100, 140)), [5, 6, 7]]
    for i, p in enumerate(ps):
        engine.add_request(f"c{i}", p, SamplingParams(max_tokens=10, **GREEDY))
    out = drain(engine)
    for i, p in enumerate(ps):
        assert out[f"c{i}"].token_ids == ref.greedy(p, 10)


def test_prefix_cache_hits_equal_reference(tiny_model_dir, ref):
    engine = make_engine(tiny_model_dir)
    system = list(range(10, 60))  # 50 shared tokens = 3 full blocks
    first = system + [200, 201, 202]
    engine.add_request("first", first, SamplingParams(max_tokens=8, **GREEDY))
    drain(engine)
    second = system + [250, 251, 252, 253]
    engine.add_request("second", second, SamplingParams(max_tokens=8, **GREEDY))
    out = drain(engine)
    assert out["second"].cached_tokens == 48
    assert out["second"].token_ids == ref.greedy(second, 8)
    # A prompt that is entirely cached still recomputes its last block to get logits.
    engine.add_request("again", first, SamplingParams(max_tokens=8, **GREEDY))
    out = drain(engine)
    assert out["again"].cached_tokens == 48
    assert out["again"].token_ids == ref.greedy(first, 8)


def test_preemption_keeps_output_exact(tiny_model_dir, ref):
    # 12 blocks of 16 tokens for 4 requests that each grow to 3 blocks: someone must be preempted.
    page_bytes = 2 * 16 * 2 * 16 * 4 * 2  # k+v, slots, kv heads, head dim, fp32, layers
    engine = make_engine(tiny_model_dir, kv_cache_gb=10 * page_bytes / 2**30)
    assert engine.blocks.num_blocks == 10
    ps = [[(17 * i + j) % 300 + 3 for j in range(20)] for i in range(4)]
    for i, p in enumerate(ps):
        engine.add_request(f"p{i}", p, SamplingParams(max_tokens=25, **GREEDY))
    out = drain(engine)
    assert engine.scheduler.num_preemptions > 0
    for i, p in enumerate(ps):
        assert out[f"p{i}"].token_ids == ref.greedy(p, 25)
    stats = engine.blocks.stats()
    assert stats.used == 0 and stats.free + stats.cached == stats.total


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM"])
def test_qkv_bias_architecture_equals_reference(tmp_path, arch):
    from tiny_model import make_tiny_llama

    d = make_tiny_llama(tmp_path / "qwen", architecture=arch, tie=False, kv_heads=1)
    engine = make_engine(d)
    p = list(range(3, 40))
    engine.add_request("q", p, SamplingParams(max_tokens=8, **GREEDY))
    assert drain(engine)["q"].token_ids == Reference(d).greedy(p, 8)


def test_decode_groups_by_context_length_equal_reference(tiny_model_dir, ref):
    # One long context among short ones: decodes run in separately padded groups.
    from engine.batch.model_runner import _length_groups

    assert [list(g) for g in _length_groups([1, 1, 2, 19, 20])] == [[0, 1, 2], [3, 4]]
    engine = make_engine(tiny_model_dir)
    ps = [prompt for prompt in prompts(3)] + [[(5 * j) % 300 + 3 for j in range(300)]]
    for i, p in enumerate(ps):
        engine.add_request(f"g{i}", p, SamplingParams(max_tokens=6, **GREEDY))
    out = drain(engine)
    for i, p in enumerate(ps):
        assert out[f"g{i}"].token_ids == ref.greedy(p, 6)


def test_short_prompt_is_not_stuck_behind_a_long_prefill(tiny_model_dir, ref):
    engine = make_engine(tiny_model_dir, max_num_seqs=4, max_num_batched_tokens=32)
    long_prompt = [(3 * j) % 300 + 3 for j in range(600)]
    engine.add_request("long", long_prompt, SamplingParams(max_tokens=3, **GREEDY))
    engine.step()
    engine.add_request("short", [5, 6, 7, 8], SamplingParams(max_tokens=3, **GREEDY))
    first_token_step: dict[str, int] = {}
    tokens: dict[str, list[int]] = {"long": [], "short": []}
    for step in range(1, 100):
        for o in engine.step():
            first_token_step.setdefault(o.request_id, step)
            tokens[o.request_id] += o.token_ids
        if not engine.has_work:
            break
    assert first_token_step["short"] <= 2 < first_token_step["long"]  # ~19 steps of 32-token chunks
    assert tokens["short"] == ref.greedy([5, 6, 7, 8], 3) and tokens["long"] == ref.greedy(long_prompt, 3)


def test_prefill_chunks_shrink_while_streams_decode(tiny_model_dir, ref):
    """--max-prefill-tokens-while-decoding: a long prompt arriving while another request decodes is
    computed at most 16 tokens per step (those steps also carry the decode); alone it takes the
    whole budget. Outputs stay exact."""
    class Watch:  # a StepObserver that records each step's batch
        def __init__(self):
            self.steps = []

        def before_forward(self, batch):
            self.steps.append([(s.seq.request_id, s.num_tokens) for s in batch])

        def after_layer(self, layer):
            pass

        def after_forward(self):
            return {}

    engine = make_engine(tiny_model_dir, max_num_seqs=4, max_num_batched_tokens=128,
                         max_prefill_tokens_while_decoding=16)
    engine.add_request("stream", [5, 6, 7, 8], SamplingParams(max_tokens=40, **GREEDY))
    tokens: dict[str, list[int]] = {"long": [], "stream": engine.step()[0].token_ids}  # its prompt; now it decodes
    long_prompt = [(3 * j) % 300 + 3 for j in range(200)]
    engine.add_request("long", long_prompt, SamplingParams(max_tokens=3, **GREEDY))
    watch = Watch()
    while engine.has_work:
        for o in engine.step(watch):
            tokens[o.request_id] += o.token_ids
    chunks = [dict(step)["long"] for step in watch.steps if "stream" in dict(step) and dict(step).get("long", 0) > 1]
    assert len(chunks) >= 12 and max(chunks) <= 16  # 200 prompt tokens, 16 at a time beside the decode
    assert tokens["long"] == ref.greedy(long_prompt, 3) and tokens["stream"] == ref.greedy([5, 6, 7, 8], 40)
    alone = make_engine(tiny_model_dir, max_num_seqs=4, max_num_batched_tokens=128,
                        max_prefill_tokens_while_decoding=16)
    alone.add_request("long", long_prompt, SamplingParams(max_tokens=3, **GREEDY))
    assert alone.scheduler.schedule()[0].num_tokens == 128  # nothing decoding: the whole budget


def test_the_prefill_cap_defaults_by_device():
    """Unset: 24 prompt tokens per step beside decodes on CPU (a chunk costs a decode row per token
    there), no cap on CUDA; 0 asks for the whole step budget on either; the worker flag reads 0 as 0."""
    import argparse

    from engine.engine_config import CPU_PREFILL_WHILE_DECODING, EngineConfig
    from worker.config import add_engine_args, engine_config_from

    assert EngineConfig(device="cpu").prefill_cap == CPU_PREFILL_WHILE_DECODING == 24
    assert EngineConfig(device="cuda").prefill_cap is None
    assert EngineConfig(device="cpu", max_prefill_tokens_while_decoding=0).prefill_cap is None
    assert EngineConfig(device="cpu", max_prefill_tokens_while_decoding=64).prefill_cap == 64
    with pytest.raises(ValueError, match="max-prefill-tokens-while-decoding"):
        EngineConfig(max_prefill_tokens_while_decoding=-1).validate()
    p = argparse.ArgumentParser()
    add_engine_args(p)
    for flag, value in (("0", 0), ("32", 32)):
        assert engine_config_from(p.parse_args(["--max-prefill-tokens-while-decoding", flag])).prefill_cap == (value or None)
    assert engine_config_from(p.parse_args([])).max_prefill_tokens_while_decoding is None


def test_burst_sharing_a_new_prefix_computes_it_once(tiny_model_dir, ref):
    """Requests arriving together with the same uncached system prompt: the first computes it,
    the others wait for it instead of computing it again, and all outputs stay exact."""
    engine = make_engine(tiny_model_dir, max_num_seqs=8, max_num_batched_tokens=64)
    system = [(5 * j) % 300 + 3 for j in range(160)]  # 10 blocks, 3 steps of 64-token chunks
    prompts = {f"r{i}": system + [100 + i, 7, 9 + i] for i in range(4)}
    for rid, p in prompts.items():
        engine.add_request(rid, p, SamplingParams(max_tokens=4, **GREEDY))
    hit0 = engine.blocks.prefix_hit_tokens
    out = drain(engine)
    for rid, p in prompts.items():
        assert out[rid].token_ids == ref.greedy(p, 4), rid
    assert [out[f"r{i}"].cached_tokens for i in range(4)] == [0, 160, 160, 160]
    assert engine.blocks.prefix_hit_tokens - hit0 == 3 * 160
    assert engine.scheduler.num_prefix_waits > 0
    # While a new prefix is being computed, only requests that need it wait; others run.
    other = [(7 * j) % 300 + 3 for j in range(40)]
    engine.add_request("a", other + [1], SamplingParams(max_tokens=2, **GREEDY))
    engine.add_request("b", other + [2], SamplingParams(max_tokens=2, **GREEDY))
    engine.add_request("c", [9, 8, 7, 6, 5], SamplingParams(max_tokens=2, **GREEDY))
    engine.step()
    assert [s.request_id for s in engine.scheduler.waiting] == ["b"]
    out = drain(engine)
    assert out["b"].cached_tokens == 32 and out["b"].token_ids == ref.greedy(other + [2], 2)


def test_long_tensor_equals_torch_tensor():
    """The runner builds its index tensors through numpy (`model_runner.long_tensor`); torch.tensor is the
    reference: the same values, shape and dtype for flat, nested, empty and large lists."""
    import torch

    from engine.batch.model_runner import long_tensor

    cpu = torch.device("cpu")
    for values in ([], [7], [3, 1, 2**40], [[1, 2, 3], [4, 5, 6]], [[i * 20 + j for j in range(20)] for i in range(64)]):
        got, want = long_tensor(values, cpu), torch.tensor(values, dtype=torch.long)
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    with pytest.raises(ValueError):  # a ragged table is an error, not an object array
        long_tensor([[1, 2], [3]], cpu)


def test_prepare_decodes_equals_prepare_any(tiny_model_dir):
    """A batch of plain decodes takes `ModelRunner.prepare_decodes`; the general `prepare_any` is the
    reference: the same tensors, length groups, sampled rows and batch order, for contexts far enough
    apart to make several groups, a context ending on a block boundary, and a sequence admitted late."""
    import torch

    engine = make_engine(tiny_model_dir, block_size=4, max_num_seqs=16, enable_prefix_cache=False)
    lengths = [3, 4, 5, 9, 16, 17, 40, 41, 90, 2, 7, 63]
    for i, n in enumerate(lengths):
        engine.add_request(f"r{i}", [(7 * i + j) % 200 + 3 for j in range(n)], SamplingParams(max_tokens=50, **GREEDY))
        for _ in range(i % 3):
            engine.step()
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.seqs.values()):
        engine.step()
    checked = 0
    for _ in range(6):  # several steps: contexts cross block boundaries as they grow
        batch = engine.scheduler.schedule()
        assert batch and all(s.num_tokens == 1 and s.samples for s in batch)
        fast, ref = list(batch), list(batch)
        ids, pos, meta, rows = engine.runner.prepare_decodes(fast)
        ids_r, pos_r, meta_r, rows_r = engine.runner.prepare_any(ref)
        assert [id(s) for s in fast] == [id(s) for s in ref] and rows == rows_r
        assert torch.equal(ids, ids_r) and torch.equal(pos, pos_r)
        assert torch.equal(meta.k_rows, meta_r.k_rows) and torch.equal(meta.v_rows, meta_r.v_rows)
        assert not meta.prefills and not meta_r.prefills and len(meta.decodes) == len(meta_r.decodes)
        for d, d_r in zip(meta.decodes, meta_r.decodes, strict=True):
            assert d.start == d_r.start and torch.equal(d.blocks, d_r.blocks) and torch.equal(d.mask, d_r.mask)
            assert d.context_lens is not None and d_r.context_lens is not None
            assert torch.equal(d.context_lens, d_r.context_lens) and d.context_lens.dtype == d_r.context_lens.dtype
        checked += len(meta.decodes) > 1
        # the step itself, so the next one sees longer contexts (the runner reorders `batch` as prepare did)
        samples = engine.runner.run(batch)
        for s, sampled in zip(batch, samples, strict=True):
            engine._commit(s, sampled, None)
    assert checked, "the contexts never made more than one length group"
