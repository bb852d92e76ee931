"""Constrained decoding in the engine: output always matches the grammar, under batching with
unconstrained requests, every sampling option, preemption, a prefill → decode KV transfer and a
failover resume; seeded sampling gives the same tokens wherever each token is drawn."""

from __future__ import annotations

import json

import jsonschema
import pytest
from engine_helpers import drain, make_engine
from grpc_client import generate, greedy
from hf_models import make_hf_model
from procs import address, start_worker, stop_all

from common import grammar
from common.errors import RequestError
from common.sampling_params import SamplingParams
from protos import splitfire_pb2 as pb

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["city", "days", "unit", "tags"],
    "additionalProperties": False,
}
GRAMMAR = grammar.json_schema(SCHEMA, "response_format")
MAX = 80  # enough for the longest object the schema allows


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_hf_model("qwen3", tmp_path_factory.mktemp("qwen3") / "m")


def prompt(i: int) -> list[int]:
    return [(11 * i + 5 * j) % 390 + 3 for j in range(12 + 9 * i)]


def valid(text: str) -> dict:
    obj = json.loads(text)
    jsonschema.validate(obj, SCHEMA)
    return obj


SETTINGS = [
    dict(temperature=0.0),
    dict(temperature=1.0, seed=7),
    dict(temperature=0.9, top_p=0.8, top_k=40, seed=3),
    dict(temperature=1.2, min_p=0.05, repetition_penalty=1.3, frequency_penalty=0.5, seed=11),
    dict(temperature=0.7, seed=5, logprobs=3),
]


def test_constrained_output_matches_the_schema_beside_unconstrained_requests(model):
    engine = make_engine(model.path, max_num_batched_tokens=32, max_num_seqs=16)
    for i, kw in enumerate(SETTINGS):
        engine.add_request(f"c{i}", prompt(i), SamplingParams(max_tokens=MAX, grammar=GRAMMAR, **kw))
        engine.add_request(f"u{i}", prompt(i), SamplingParams(max_tokens=12, ignore_eos=True, **kw))
    out = drain(engine)
    for i, kw in enumerate(SETTINGS):
        assert out[f"c{i}"].finish_reason == "stop", (kw, out[f"c{i}"].text)
        valid(out[f"c{i}"].text)
        assert len(out[f"u{i}"].token_ids) == 12  # the unconstrained neighbours were not masked
    # Without the grammar the same model and prompts do not produce this JSON.
    engine.add_request("free", prompt(0), SamplingParams(max_tokens=MAX, temperature=0.0))
    with pytest.raises(json.JSONDecodeError):
        json.loads(drain(engine)["free"].text)


def test_grammar_survives_preemption_and_recompute(model):
    page = 2 * 16 * 2 * 32 * 4 * 3  # k+v, slots, kv heads, head_dim, fp32, layers
    tight = make_engine(model.path, kv_cache_gb=9 * page / 2**30)
    roomy = make_engine(model.path)
    for engine in (tight, roomy):
        for i in range(4):
            engine.add_request(f"p{i}", prompt(i), SamplingParams(max_tokens=MAX, temperature=0.0, grammar=GRAMMAR))
    out_tight, out_roomy = drain(tight), drain(roomy)
    assert tight.scheduler.num_preemptions > 0
    for i in range(4):
        valid(out_tight[f"p{i}"].text)
        assert out_tight[f"p{i}"].token_ids == out_roomy[f"p{i}"].token_ids


@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(temperature=1.0, seed=42)])
def test_a_resumed_request_continues_the_same_tokens_and_grammar(model, kw):
    """A failover re-sends prompt + output so far with resumed_tokens: the grammar state, the seeded
    noise and the penalties pick up where the first worker stopped."""
    engine = make_engine(model.path)
    p = prompt(2)
    kw = {**kw, "frequency_penalty": 0.4}
    engine.add_request("whole", p, SamplingParams(max_tokens=MAX, grammar=GRAMMAR, **kw))
    whole = drain(engine)["whole"]
    valid(whole.text)
    k = len(whole.token_ids) // 2
    engine.add_request("rest", p + whole.token_ids[:k],
                       SamplingParams(max_tokens=MAX - k, grammar=GRAMMAR, resumed_tokens=k, **kw))
    assert drain(engine)["rest"].token_ids == whole.token_ids[k:]


def test_a_resumed_output_that_breaks_the_grammar_is_refused(model):
    engine = make_engine(model.path)
    bad = engine.tokenizer.encode("not json")
    with pytest.raises(RequestError, match="does not match the grammar"):
        engine.add_request("x", prompt(1) + bad, SamplingParams(max_tokens=5, grammar=GRAMMAR, resumed_tokens=len(bad)))


def test_an_invalid_grammar_is_refused(model):
    engine = make_engine(model.path)
    with pytest.raises(RequestError, match="grammar"):
        engine.add_request("x", prompt(1), SamplingParams(max_tokens=5, grammar="start: (("))


def test_invalid_or_unsupported_schemas_are_named():
    with pytest.raises(grammar.GrammarError, match="Invalid type") as e:
        grammar.response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objx"}}})
    assert e.value.param == "response_format.json_schema.schema"
    with pytest.raises(grammar.GrammarError, match="dependentSchemas"):
        grammar.response_format({"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "dependentSchemas": {"a": {}}}}})
    with pytest.raises(grammar.GrammarError, match="name"):
        grammar.response_format({"type": "json_schema", "json_schema": {"schema": {}}})
    with pytest.raises(grammar.GrammarError, match=r"response_format\.type"):
        grammar.response_format({"type": "xml"})
    assert grammar.response_format({"type": "text"}) is None


async def test_disaggregated_constrained_and_seeded_output_equals_colocated(model, tmp_path):
    """The prefill worker draws the first token under the grammar and with the seed's first noise;
    the decode worker continues both: the whole output equals the colocated one, token for token."""
    pre = start_worker("prefill", model.path, tmp_path, wait=False)
    dec = start_worker("decode", model.path, tmp_path, "--local-prefill-max-tokens", "0", wait=False)
    both = start_worker("both", model.path, tmp_path, wait=False)
    try:
        for w in (pre, dec, both):
            w.wait_for("worker ready")
        cases = [greedy(MAX, ignore_eos=False, grammar=GRAMMAR),
                 pb.SamplingParams(max_tokens=MAX, temperature=1.0, seed=9, grammar=GRAMMAR),
                 pb.SamplingParams(max_tokens=24, temperature=1.0, seed=9, ignore_eos=True)]  # seeded, unconstrained
        for i, sp in enumerate(cases):
            p = prompt(i + 3)
            split = await generate(address(dec), p, sp, prefill=address(pre))
            joint = await generate(address(both), p, sp)
            assert split.prefill_mode == "remote"
            assert split.token_ids == joint.token_ids, i
            if sp.grammar:
                valid(split.text)
                # The first token, drawn by the prefill worker, is already inside the grammar.
                assert split.text.startswith("{")
    finally:
        assert stop_all(pre, dec, both) == [0, 0, 0]
