"""Sampling: seeds, filters, penalties, stop conditions, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from engine_helpers import drain, make_engine

from common.errors import RequestError
from common.sampling_params import SamplingParams
from engine.batch.sampler import apply_penalties, filtered_probs


def test_same_seed_same_tokens_alone_and_in_batch(tiny_model_dir):
    sp = dict(temperature=1.0, top_p=0.95, max_tokens=20, ignore_eos=True)
    prompt = list(range(5, 30))
    alone = make_engine(tiny_model_dir)
    alone.add_request("s", prompt, SamplingParams(seed=1234, **sp))
    solo = drain(alone)["s"].token_ids

    batch = make_engine(tiny_model_dir)
    for i in range(6):
        batch.add_request(f"n{i}", list(range(40 + i, 60 + 2 * i)), SamplingParams(**sp))
    batch.add_request("s", prompt, SamplingParams(seed=1234, **sp))
    batched = drain(batch)
    assert batched["s"].token_ids == solo
    # And a different seed diverges (20 tokens over a 400-token vocab at T=1).
    other = make_engine(tiny_model_dir)
    other.add_request("s", prompt, SamplingParams(seed=99, **sp))
    assert drain(other)["s"].token_ids != solo


def test_top_k_top_p_min_p_filters():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    p = filtered_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[2:] == 0).all() and p[0] > p[1] > 0
    p = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    full = torch.softmax(logits, -1)
    assert full[0] < 0.7 < full[0] + full[1]
    assert (p[:2] > 0).all() and (p[2:] == 0).all()
    p = filtered_probs(logits, SamplingParams(temperature=1.0, min_p=0.3))
    assert (p > 0).tolist() == [True, True, False, False, False]


def test_penalties():
    logits = torch.tensor([2.0, -2.0, 1.0, 1.0])
    out = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1])
    assert out.tolist() == [1.0, -4.0, 1.0, 1.0]
    out = apply_penalties(logits, SamplingParams(frequency_penalty=0.5, presence_penalty=1.0), prompt=[2], output=[3, 3])
    assert out.tolist() == [2.0, -2.0, 1.0, -1.0]


def test_stop_string_never_partially_emitted(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    prompt = list(range(5, 30))
    engine.add_request("free", prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    full = drain(engine)["free"].text
    assert len(full) > 12
    stop = full[8:12]
    engine.add_request("stopped", prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))
    r = drain(engine)["stopped"]
    assert r.finish_reason == "stop"
    assert r.text == full[: full.index(stop)]


def test_max_tokens_and_stop_token_ids(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    prompt = list(range(5, 30))
    engine.add_request("len", prompt, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    r = drain(engine)["len"]
    assert len(r.token_ids) == 7 and r.finish_reason == "length"
    engine.add_request("tok", prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[r.token_ids[3]]))
    r2 = drain(engine)["tok"]
    assert r2.finish_reason == "stop" and r2.token_ids == r.token_ids[: r.token_ids.index(r.token_ids[3]) + 1]


def test_logprobs_are_normalised_and_ranked(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    seq = engine.add_request("lp", list(range(5, 20)), SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True))
    drain(engine)
    assert len(seq.logprobs) == 4
    for lp in seq.logprobs:
        assert len(lp.top) == 3
        assert lp.top[0][0] == lp.token_id  # greedy picks the most likely
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
        assert lp.logprob <= 0 and math.isclose(lp.logprob, lp.top[0][1], rel_tol=1e-6)


@pytest.mark.parametrize(
    "kw",
    [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(max_tokens=0), dict(logprobs=50),
     dict(min_p=2), dict(top_k=-1), dict(stop=[""]), dict(frequency_penalty=3)],
)
def test_invalid_sampling_is_rejected(kw):
    with pytest.raises(RequestError):
        SamplingParams(**kw).validate()


def test_logit_bias_forbids_and_forces_tokens(tiny_model_dir):
    prompt = list(range(5, 30))
    greedy = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
    eng = make_engine(tiny_model_dir)
    eng.add_request("plain", prompt, SamplingParams(**greedy))
    plain = drain(eng)["plain"].token_ids
    eng.add_request("forbid", prompt, SamplingParams(logit_bias={plain[0]: -100.0}, **greedy))
    eng.add_request("force", prompt, SamplingParams(logit_bias={7: 100.0}, **greedy))
    eng.add_request("sampled", prompt, SamplingParams(logit_bias={7: 100.0}, temperature=1.0, seed=3, max_tokens=8,
                                                      ignore_eos=True))
    out = drain(eng)
    assert plain[0] not in out["forbid"].token_ids[:1]
    assert out["force"].token_ids == [7] * 8 and out["sampled"].token_ids == [7] * 8


def test_min_tokens_holds_back_eos_and_stop_ids(tiny_model_dir):
    eng = make_engine(tiny_model_dir)
    eos = min(eng.eos_token_ids)
    prompt = list(range(5, 30))
    # EOS pushed to the top: without min_tokens the first token ends the request.
    eng.add_request("eager", prompt, SamplingParams(temperature=0.0, max_tokens=20, logit_bias={eos: 100.0}))
    eng.add_request("held", prompt, SamplingParams(temperature=0.0, max_tokens=20, logit_bias={eos: 100.0},
                                                   min_tokens=5))
    eng.add_request("stop_id", prompt, SamplingParams(temperature=0.0, max_tokens=20, logit_bias={9: 100.0},
                                                      stop_token_ids=[9], min_tokens=3, ignore_eos=True))
    out = drain(eng)
    assert len(out["eager"].token_ids) <= 1 and out["eager"].finish_reason == "stop"
    held = out["held"].token_ids
    assert out["held"].finish_reason == "stop" and 5 <= len(held) <= 6 and eos not in held[:5]
    assert out["stop_id"].finish_reason == "stop" and 9 not in out["stop_id"].token_ids[:3]


def test_logit_bias_and_min_tokens_are_validated():
    with pytest.raises(RequestError):
        SamplingParams(logit_bias={5: 101.0}).validate()
    with pytest.raises(RequestError):
        SamplingParams(max_tokens=4, min_tokens=5).validate()
    SamplingParams(max_tokens=2, min_tokens=5, resumed_tokens=3).validate()  # after a failover: whole output


# Every kind of filter and their mixes (sampled rows), for the batch samplers' equality tests.
FILTERS = [
    dict(temperature=1.0), dict(temperature=0.7, top_p=0.9), dict(temperature=1.3, top_k=40),
    dict(temperature=0.8, top_k=100, top_p=0.8), dict(temperature=1.0, min_p=0.05),
    dict(temperature=0.6, top_p=0.95, min_p=0.02), dict(temperature=1.0, top_k=1500, top_p=0.99),
    dict(temperature=2.0, top_p=0.5), dict(temperature=1.0, top_k=3),
]


def _filter_rows(seed: int, settings: list[dict]) -> tuple[torch.Tensor, list[SamplingParams], torch.Tensor]:
    """Logits [rows, 3000]: each setting on a flat, a medium and a peaked row, then a row with three equally
    likely tokens at a top-2 cut (all three kept). Returns (logits, their params, the tie row)."""
    vocab = 3000
    g = torch.Generator().manual_seed(seed)
    rows, params = [], []
    for scale in (0.3, 2.0, 6.0):  # flat, medium, peaked
        for kw in settings:
            rows.append(torch.randn(vocab, generator=g) * scale)
            params.append(SamplingParams(**kw))
    tie = torch.randn(vocab, generator=g)
    tie[[5, 900, 2999]] = 4.0
    rows.append(tie)
    params.append(SamplingParams(temperature=1.0, top_k=2))
    return torch.stack(rows), params, tie


def test_sample_batch_equals_the_plain_reference_row_by_row():
    """`sample_batch` (what the engine runs: cuts from the most likely tokens, a draw among the kept
    ones) against `draw(filtered_probs(row))` one row at a time, each row with its own seeded
    generator: the same tokens, for every kind of filter and their mixes, peaked rows (cut among the
    first candidates), flat ones (cut past them: a whole-row sort), a tie at a cut and rounding of the
    last kept token; and the reference's distribution is what the filters promise."""
    from engine.batch.sampler import draw, sample_batch, seeded_generator

    logits, params, tie = _filter_rows(7, FILTERS)
    for draw_index in range(4):
        gens = [seeded_generator(11 + i, draw_index, torch.device("cpu")) for i in range(len(params))]
        got = sample_batch(logits, params, gens)
        gens = [seeded_generator(11 + i, draw_index, torch.device("cpu")) for i in range(len(params))]
        want = [draw(filtered_probs(logits[i], sp), gens[i]) for i, sp in enumerate(params)]
        assert got == want
    kept = filtered_probs(tie, SamplingParams(temperature=1.0, top_k=2)) > 0
    assert kept.nonzero().flatten().tolist() == [5, 900, 2999]
    # unseeded rows draw only kept tokens
    for i, t in enumerate(sample_batch(logits, params, [None] * len(params))):
        assert filtered_probs(logits[i], params[i])[t] > 0


def test_sampling_on_the_device_equals_sample_batch_and_reads_nothing_back():
    """`sample_on_device` (a queued step's sampler: whole sorted rows, every setting a tensor) against
    `sample_batch` with the same uniform draws: the same tokens for every filter and their mixes, flat
    and peaked rows, a tie at a cut, top-k past the first candidates, greedy rows among them; and no
    host read or data-sized op while it runs (so on a GPU it never waits for the device)."""
    from engine.batch.graph_runner import HostSyncProbe
    from engine.batch.sampler import row_settings, sample_batch, sample_on_device, seeded_generator

    logits, params, _ = _filter_rows(9, [*FILTERS, dict(temperature=0.0), dict(temperature=0.9, top_k=1)])
    table = torch.tensor([row_settings(sp) for sp in params], dtype=torch.float32)
    drawn = [i for i, sp in enumerate(params) if not sp.greedy]
    for draw_index in range(4):
        gens = [seeded_generator(11 + i, draw_index, torch.device("cpu")) for i in drawn]
        want = dict(zip(drawn, sample_batch(logits[drawn], [params[i] for i in drawn], gens), strict=True))
        u = torch.zeros(len(params))
        for i in drawn:
            u[i] = torch.rand((), generator=seeded_generator(11 + i, draw_index, torch.device("cpu")))
        probe = HostSyncProbe("cpu")
        with probe:
            got = sample_on_device(logits, table, u)
        assert probe.seen == []
        got_list = got.tolist()
        assert {i: got_list[i] for i in drawn} == want
        assert all(got_list[i] == int(logits[i].argmax()) for i, sp in enumerate(params) if sp.greedy)


def test_sample_rows_on_the_device_path_equals_sample_batch(monkeypatch):
    """`sample_rows` (what `sample` and speculative verification call): its GPU path (`sample_on_device`,
    forced here on CPU tensors) draws the same tokens as `sample_batch` for the same rows and draws —
    seeded rows, and unseeded ones from the same state of torch's generator."""
    from engine.batch import sampler
    from engine.batch.sampler import sample_rows, seeded_generator

    calls: list[bool] = []
    for name in ("sample_on_device", "sample_batch"):
        real = getattr(sampler, name)
        monkeypatch.setattr(sampler, name, lambda *a, _r=real, _n=name: calls.append(_n == "sample_on_device") or _r(*a))

    logits, params, _ = _filter_rows(13, FILTERS)
    cpu = torch.device("cpu")
    for draw_index in range(3):
        got = {}
        for on_device in (False, True):
            gens = [seeded_generator(5 + i, draw_index, cpu) if i % 2 else None for i in range(len(params))]
            torch.manual_seed(draw_index)
            got[on_device] = sample_rows(logits, params, gens, on_device=on_device)
            assert calls.pop() == on_device
        assert got[True] == got[False]


def test_draw_never_picks_a_token_of_zero_probability():
    """Zero-probability tokens between, before and after the kept ones are never drawn."""
    from engine.batch.sampler import draw

    probs = torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0])
    g = torch.Generator().manual_seed(0)
    seen = {draw(probs, g) for _ in range(200)}
    assert seen == {1, 3}
