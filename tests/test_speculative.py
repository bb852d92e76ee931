"""Speculative decoding (prompt lookup and a draft model): greedy output identical to one token per
step, whatever the drafts — all accepted, all rejected, n-gram guesses or a draft model's — with
chunked prefill, prefix hits, aborts and in the disaggregated decode worker."""

from __future__ import annotations

import asyncio

from engine_helpers import drain, make_engine
from grpc_client import generate, greedy, wait_blocks_free
from procs import address, start_worker

from common.sampling_params import SamplingParams
from engine.spec.speculative import ngram_draft, verify


def _prompts() -> list[list[int]]:
    return [[(7 * i + j) % 50 + 3 for j in range(40 + 13 * i)] for i in range(4)] + [[5, 6, 7, 8] * 20]


def _run(model_dir, prompts, max_tokens=48, **kw) -> tuple[dict[str, list[int]], object]:
    eng = make_engine(model_dir, **kw)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    out = drain(eng)
    assert eng.blocks.stats().used == 0  # nothing leaked, rejected slots included
    return {k: v.token_ids for k, v in out.items()}, eng


def test_verify_and_ngram_draft():
    assert verify([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all accepted + the bonus token
    assert verify([4, 5, 6], [9, 5, 6, 7]) == [9]  # all rejected: the model's own token
    assert verify([4, 5, 6], [4, 8, 6, 7]) == [4, 8]
    assert ngram_draft([1, 2, 3, 9, 9, 1, 2, 3], 3) == [9, 9, 1]  # the latest earlier match of [1, 2, 3]
    assert ngram_draft([1, 2, 3, 4], 2) == []
    assert ngram_draft([256, 1, 256], 1) == [1]  # matches are token-aligned (no byte-level false hits)


def test_ngram_speculation_is_lossless_and_drafts_get_accepted(tiny_model_dir):
    base, _ = _run(tiny_model_dir, _prompts())
    spec, eng = _run(tiny_model_dir, _prompts(), speculative="ngram", speculative_max_batch=8)
    assert spec == base
    assert eng.drafter.drafted > 0 and eng.drafter.accepted > 0  # it did speculate, and some drafts held
    # Chunked prefill (8-token steps) and prefix hits (the same prompts twice) change nothing either.
    again, _ = _run(tiny_model_dir, _prompts() + _prompts(), speculative="ngram", speculative_max_batch=16,
                    max_num_batched_tokens=64, max_num_seqs=16)
    assert all(again[str(i)] == base[str(i % 5)] for i in range(10))


class _Oracle:
    """A drafter that proposes the true continuation (all accepted) or a wrong one (all rejected)."""

    def __init__(self, truth: dict[str, list[int]], wrong: bool, k: int = 4):
        self.truth, self.wrong, self.k = truth, wrong, k
        self.drafted = self.accepted = self.steps = 0

    def propose_many(self, seqs, running, rooms):
        return [self.propose(s, running, r) for s, r in zip(seqs, rooms, strict=True)]

    def propose(self, seq, running, room):
        n = len(seq.output_token_ids)
        future = self.truth[seq.request_id][n:n + min(self.k, room)]
        return [(t + 1) % 50 + 3 for t in future] if self.wrong else future

    def record(self, seq, drafted, accepted):
        self.drafted += drafted
        self.accepted += accepted
        self.steps += 1

    def release(self, seq):
        pass


def test_all_accepted_and_all_rejected_drafts_give_the_same_tokens(tiny_model_dir):
    base, _ = _run(tiny_model_dir, _prompts())
    for wrong in (False, True):
        eng = make_engine(tiny_model_dir, speculative="ngram")
        eng.drafter = eng.scheduler.drafter = _Oracle(base, wrong)
        for i, p in enumerate(_prompts()):
            eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
        out = {k: v.token_ids for k, v in drain(eng).items()}
        assert out == base
        d = eng.drafter
        assert d.drafted > 0 and (d.accepted == 0 if wrong else d.accepted == d.drafted), (wrong, d.accepted, d.drafted)
        if not wrong:
            assert d.steps <= 5 * 48 / 4  # ~5 tokens per step instead of 1
        assert eng.blocks.stats().used == 0


def test_aborting_mid_speculation_frees_every_block(tiny_model_dir):
    eng = make_engine(tiny_model_dir, speculative="ngram", speculative_max_batch=8)
    for i, p in enumerate(_prompts()):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(12):
        eng.step()
    assert eng.drafter.steps > 0
    for i in range(5):
        eng.abort(str(i))
    assert eng.blocks.stats().used == 0


async def test_disaggregated_decode_worker_speculates_losslessly(tiny_model_dir, tmp_path):
    pre = start_worker("prefill", tiny_model_dir, tmp_path, name="spec-pre")
    plain = start_worker("decode", tiny_model_dir, tmp_path, "--local-prefill-max-tokens", "0", "--speculative", "off",
                         name="plain-dec")
    spec = start_worker("decode", tiny_model_dir, tmp_path, "--local-prefill-max-tokens", "0", "--speculative",
                        "ngram", "--speculative-max-batch", "8", name="spec-dec")
    try:
        prompts = _prompts()
        want = await asyncio.gather(*(generate(address(plain), p, greedy(40), prefill=address(pre)) for p in prompts))
        got = await asyncio.gather(*(generate(address(spec), p, greedy(40), prefill=address(pre)) for p in prompts))
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        assert [g.usage.completion_tokens for g in got] == [40] * len(prompts)
        await wait_blocks_free(address(spec))
        import urllib.request

        body = urllib.request.urlopen(f"http://127.0.0.1:{spec.ports['metrics']}/metrics", timeout=5).read().decode()
        assert 'splitfire_worker_spec_tokens{kind="drafted",role="decode"}' in body
    finally:
        for p in (spec, plain, pre):
            p.stop()


def test_a_speculative_finish_keeps_the_output_blocks_cached(tiny_model_dir):
    """The step that ends a request may commit several tokens; their full blocks must reach the
    prefix cache before the request's blocks are released (the next turn reuses them)."""
    prompts = _prompts()
    base, _ = _run(tiny_model_dir, prompts)

    def next_turn_hits(drafter_truth: dict | None) -> list[int]:
        eng = make_engine(tiny_model_dir, speculative="ngram")
        if drafter_truth is not None:
            eng.drafter = eng.scheduler.drafter = _Oracle(drafter_truth, wrong=False)
        else:
            eng.drafter = eng.scheduler.drafter = None
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
        drain(eng)
        for i, p in enumerate(prompts):
            eng.add_request(f"t2-{i}", p + base[str(i)] + [9, 9], SamplingParams(temperature=0, max_tokens=1))
        out = drain(eng)
        return [out[f"t2-{i}"].cached_tokens for i in range(len(prompts))]

    assert next_turn_hits(base) == next_turn_hits(None)


def test_seeded_sampled_requests_speculate_and_emit_the_tokens_they_would_without(tiny_model_dir):
    """Sampled speculation draws each row's token as the sampler would (the seeded generator of that
    token's index), so a seeded request's output is the same with drafts as without."""
    def run(spec: str):
        eng = make_engine(tiny_model_dir, speculative=spec, speculative_max_batch=8)
        for i, p in enumerate(_prompts()):
            eng.add_request(str(i), p, SamplingParams(temperature=0.7, top_p=0.95, top_k=40, seed=11 + i,
                                                      max_tokens=40, ignore_eos=True))
        out = {k: v.token_ids for k, v in drain(eng).items()}
        assert eng.blocks.stats().used == 0
        return out, eng

    base, _ = run("off")
    spec, eng = run("ngram")
    assert spec == base
    assert eng.drafter.drafted > 0 and eng.drafter.accepted > 0


def test_unseeded_sampled_verification_keeps_the_target_distribution():
    """The first token a verification emits, over 20,000 unseeded draws with the same draft, against
    the target distribution (temperature 0.8, top-k 20): chi-square below its 0.999 quantile, and
    the draft accepted at the rate p(draft) (speculative rejection sampling for a point-mass draft).
    torch's global seed is fixed, so the test is deterministic."""
    import math

    import torch

    from engine.batch.sampler import filtered_probs, speculative_targets
    from engine.batch.sequence import Sequence

    torch.manual_seed(0)
    vocab, draft = 50, [3, 9]
    rows = torch.randn(3, vocab) * 2
    rows[0, 3] += 2.5  # a draft the target likes, but not always
    sp = SamplingParams(temperature=0.8, top_k=20)
    seq = Sequence("r", [1, 2], sp)
    p = filtered_probs(rows[0], sp)
    p = p / p.sum()
    n = 20_000
    counts = torch.zeros(vocab)
    accepted = 0
    for _ in range(n):
        first = verify(draft, speculative_targets(rows, seq, draft))[0]
        counts[first] += 1
        accepted += first == draft[0]
    expected = p * n
    keep = expected >= 5  # rare tokens pooled into one cell, as chi-square needs
    obs = torch.cat([counts[keep], counts[~keep].sum().view(1)])
    exp = torch.cat([expected[keep], expected[~keep].sum().view(1)])
    chi2 = float(((obs - exp) ** 2 / exp.clamp(min=1e-9)).sum())
    dof = int(keep.sum())
    z = 3.090  # the 0.999 normal quantile; Wilson-Hilferty approximation of the chi-square quantile
    bound = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < bound, (chi2, dof, bound)
    assert counts[~(p > 0)].sum() == 0  # nothing outside top-k ever emitted
    assert abs(accepted / n - float(p[3])) < 4 * math.sqrt(float(p[3]) * (1 - float(p[3])) / n)


# -- draft-model speculation ------------------------------------------------------------------


def _draft_run(model_dir, draft_dir, prompts, **kw):
    out, eng = _run(model_dir, prompts, speculative="draft", draft_model=str(draft_dir), speculative_max_batch=8, **kw)
    d = eng.drafter
    assert len(d.free) == d.kv.layout.num_blocks  # every draft block back, rejected drafts' included
    return out, eng


def test_draft_model_speculation_is_lossless_whether_drafts_are_accepted_or_not(tiny_model_dir, tmp_path):
    from tiny_model import make_tiny_llama

    prompts = _prompts()
    base, _ = _run(tiny_model_dir, prompts)
    # The target as its own draft: every draft accepted.
    same, eng = _draft_run(tiny_model_dir, tiny_model_dir, prompts)
    assert same == base
    assert eng.drafter.drafted > 0 and eng.drafter.accepted == eng.drafter.drafted
    # A different random model with the same tokenizer: drafts mostly rejected, output unchanged.
    other_dir = make_tiny_llama(tmp_path / "other", layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, seed=7)
    other, eng = _draft_run(tiny_model_dir, other_dir, prompts)
    assert other == base
    assert eng.drafter.drafted > 0 and eng.drafter.accepted < eng.drafter.drafted // 2
    # Chunked prefill (16-token steps) and a second turn with a prefix hit.
    chunked, _ = _draft_run(tiny_model_dir, tiny_model_dir, prompts, max_num_batched_tokens=16, max_num_seqs=8)
    assert chunked == base
    turn2 = [prompts[1] + base["1"] + [7, 8, 9]]
    want, _ = _run(tiny_model_dir, turn2)
    got, eng = _draft_run(tiny_model_dir, other_dir, turn2)
    assert got == want


def test_draft_model_with_seeded_sampling_and_aborts(tiny_model_dir):
    def run(spec: str):
        kw = dict(draft_model=str(tiny_model_dir)) if spec == "draft" else {}
        eng = make_engine(tiny_model_dir, speculative=spec, speculative_max_batch=8, **kw)
        for i, p in enumerate(_prompts()):
            eng.add_request(str(i), p, SamplingParams(temperature=0.7, top_p=0.95, seed=3 + i, max_tokens=30,
                                                      ignore_eos=True))
        return {k: v.token_ids for k, v in drain(eng).items()}, eng

    base, _ = run("off")
    got, eng = run("draft")
    assert got == base and eng.drafter.accepted > 0
    # Aborted mid-way: the draft cache gives every block back too.
    eng = make_engine(tiny_model_dir, speculative="draft", draft_model=str(tiny_model_dir), speculative_max_batch=8)
    for i, p in enumerate(_prompts()):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(10):
        eng.step()
    assert eng.drafter.steps > 0 and len(eng.drafter.free) < eng.drafter.kv.layout.num_blocks
    for i in range(5):
        eng.abort(str(i))
    assert eng.blocks.stats().used == 0 and len(eng.drafter.free) == eng.drafter.kv.layout.num_blocks


async def test_disaggregated_decode_worker_with_a_draft_model(tiny_model_dir, tmp_path):
    pre = start_worker("prefill", tiny_model_dir, tmp_path, name="draft-pre")
    dec = start_worker("decode", tiny_model_dir, tmp_path, "--local-prefill-max-tokens", "0", "--speculative", "draft",
                       "--draft-model", str(tiny_model_dir), "--speculative-max-batch", "8", name="draft-dec")
    try:
        prompts = _prompts()
        want, _ = _run(tiny_model_dir, prompts, max_tokens=30)
        got = await asyncio.gather(*(generate(address(dec), p, greedy(30), prefill=address(pre)) for p in prompts))
        assert [g.token_ids for g in got] == [want[str(i)] for i in range(len(prompts))]
        assert all(g.prefill_mode == "remote" for g in got)
        await wait_blocks_free(address(dec))
        import urllib.request

        body = urllib.request.urlopen(f"http://127.0.0.1:{dec.ports['metrics']}/metrics", timeout=5).read().decode()
        accepted = [line for line in body.splitlines()
                    if line.startswith('splitfire_worker_spec_tokens{kind="accepted"')]
        assert accepted and float(accepted[0].rsplit(" ", 1)[1]) > 0
    finally:
        for p in (dec, pre):
            p.stop()


def test_a_draft_model_with_another_tokenizer_is_refused(tiny_model_dir, tmp_path):
    import json
    import shutil

    import pytest

    from common.errors import ModelLoadError
    from engine.engine_config import EngineConfig

    d = tmp_path / "draft"
    shutil.copytree(tiny_model_dir, d)
    tj = json.loads((d / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: same size, different mapping
    (d / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(ModelLoadError, match="tokenizer is not the target's"):
        make_engine(tiny_model_dir, speculative="draft", draft_model=str(d))
    with pytest.raises(ValueError, match="--draft-model"):
        EngineConfig(speculative="draft").validate()
    with pytest.raises(ValueError, match="--draft-model"):
        EngineConfig(draft_model=str(d)).validate()


def test_draft_model_proposals_are_batched_across_sequences(tiny_model_dir):
    """Three decoding sequences, k = 4: one forward feeds all three catch-up chunks, then three more
    each carry all three sequences' next draft — 4 forwards, not 12."""
    eng = make_engine(tiny_model_dir, speculative="draft", draft_model=str(tiny_model_dir), speculative_max_batch=8)
    for i, p in enumerate(_prompts()[:3]):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    while any(s.num_computed_tokens < len(s.prompt_token_ids) for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    model = eng.drafter.model
    calls: list[int] = []
    forward = model.forward
    model.forward = lambda ids, *a, **kw: calls.append(len(ids)) or forward(ids, *a, **kw)
    batch = eng.scheduler.schedule()
    assert [len(s.draft) for s in batch] == [4, 4, 4]
    assert len(calls) == 4 and calls[1:] == [3, 3, 3]
