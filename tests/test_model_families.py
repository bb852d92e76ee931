"""Every supported family equals Hugging Face transformers on the same weights.

For each family a tiny random model is built by transformers' own classes (tests/hf_models.py),
saved, and served by splitfire: greedy tokens equal transformers' for several prompts (one
longer than five KV blocks) and last-position logits agree to float32 precision, through the
continuous batch, `splitfire generate`, chunked prefill with a prefix-cache hit, a prefill
worker → decode worker KV transfer, and bfloat16 (whose error must stay within transformers'
own bfloat16 error).
"""

from __future__ import annotations

import asyncio
import copy
import json

import pytest
import torch
from engine_helpers import drain, make_engine
from grpc_client import generate, greedy, wait_blocks_free
from hf_models import FAMILIES, HFModel, make_hf_model
from procs import address, start_worker, stop_all

from common.sampling_params import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)
N = 8


def prompts() -> list[list[int]]:
    # 5, 40 and 90 tokens: inside one block, a few blocks, and longer than every tiny sliding window.
    return [[(7 * j + 31 * i) % 390 + 3 for j in range(n)] for i, n in enumerate((5, 40, 90))]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> HFModel:
    return make_hf_model(request.param, tmp_path_factory.mktemp(request.param) / "model")


def engine_logits(engine, prompt: list[int]) -> torch.Tensor:
    """Last-position logits of `prompt` through the engine's own batch preparation and model."""
    engine.add_request("logits", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    batch = engine.scheduler.schedule()
    ids, positions, meta, rows = engine.runner.prepare(batch)
    with torch.inference_mode():
        out = engine.model.logits(engine.model(ids, positions, engine.kv, meta)[rows])[0]
    engine.abort("logits")
    return out


def test_batched_greedy_tokens_and_logits_equal_transformers(family):
    engine = make_engine(family.path)
    ps = prompts()
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=N, **GREEDY))
    out = drain(engine)
    for i, p in enumerate(ps):
        assert out[f"r{i}"].token_ids == family.greedy(p, N), f"{family.name}: prompt {i} ({len(p)} tokens)"
    for p in ps:
        ours, theirs = engine_logits(engine, p), family.logits(p)
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_splitfire_generate_equals_transformers(family, tmp_path):
    from splitfire_cli import main

    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"prompt_token_ids": p, "max_tokens": N, **GREEDY}) + "\n" for p in prompts()))
    rc = main(["generate", "--model", str(family.path), "--device", "cpu", "--kv-cache-gb", "0.01",
               "--input", str(src), "--output", str(dst), "--quiet"])
    assert rc == 0
    got = [json.loads(line)["token_ids"] for line in dst.read_text().splitlines()]
    assert got == [family.greedy(p, N) for p in prompts()]


def test_chunked_prefill_with_prefix_hit_equals_transformers(family):
    # 16-token steps: every prompt is computed in chunks; the second prompt reuses 3 cached blocks.
    engine = make_engine(family.path, max_num_seqs=4, max_num_batched_tokens=16)
    first = prompts()[2]
    engine.add_request("first", first, SamplingParams(max_tokens=N, **GREEDY))
    assert drain(engine)["first"].token_ids == family.greedy(first, N)
    second = first[:48] + [11, 12, 13, 14, 15]
    engine.add_request("second", second, SamplingParams(max_tokens=N, **GREEDY))
    out = drain(engine)["second"]
    assert out.cached_tokens == 48
    assert out.token_ids == family.greedy(second, N)


def test_bfloat16_error_is_within_transformers_own(family):
    engine = make_engine(family.path, dtype="bfloat16")
    reference_bf16 = copy.deepcopy(family.model).to(torch.bfloat16)
    for p in prompts()[1:]:
        exact = family.logits(p)
        with torch.no_grad():
            theirs = reference_bf16(torch.tensor([p])).logits[0, -1].float()
        ours = engine_logits(engine, p)
        ours_err, their_err = (ours - exact).abs().max().item(), (theirs - exact).abs().max().item()
        assert ours_err <= 2 * their_err + 0.02, f"{family.name}: bf16 error {ours_err:.3f} vs transformers' {their_err:.3f}"


async def test_prefill_to_decode_transfer_equals_transformers(family, tmp_path):
    pre = start_worker("prefill", family.path, tmp_path, "--max-num-batched-tokens", "32", "--max-num-seqs", "8",
                       wait=False)
    dec = start_worker("decode", family.path, tmp_path, "--local-prefill-max-tokens", "0", wait=False)
    try:
        for w in (pre, dec):
            w.wait_for("worker ready")
        ps = prompts()
        got = await asyncio.gather(*(generate(address(dec), p, greedy(N), prefill=address(pre)) for p in ps))
        for p, g in zip(ps, got, strict=True):
            assert g.prefill_mode == "remote"
            assert g.token_ids == family.greedy(p, N)
        # A second turn: the decode worker holds the first turn's blocks; only the rest crosses.
        turn2 = ps[2] + got[2].token_ids + [21, 22, 23, 24, 25, 26, 27]
        second = await generate(address(dec), turn2, greedy(N), prefill=address(pre))
        assert second.prefill_mode == "remote" and second.usage.cached_tokens == 96
        assert second.token_ids == family.greedy(turn2, N)
        await wait_blocks_free(address(dec))
    finally:
        assert stop_all(pre, dec) == [0, 0], pre.log()[-1000:] + dec.log()[-1000:]
