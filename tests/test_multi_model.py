"""Several models behind one router (`splitfire up --model A --model B`, router `--extra-model`): a
request's `model` picks the workers that serve it, each model's own tokenizer and context length
answer for it, and its tokens equal transformers' greedy tokens of that model."""

from __future__ import annotations

import signal

import aiohttp
import pytest
from hf_models import make_hf_model
from procs import free_port, spawn

from common.tokenizer import Tokenizer

N = 6


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return (make_hf_model("llama3", root / "llama-a", seed=1, max_position_embeddings=512),
            make_hf_model("qwen3", root / "qwen-b", seed=2, max_position_embeddings=1024))


async def _post(s: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with s.post(url, json=body) as r:
        return r.status, await r.json()


async def test_one_router_serves_two_models_each_on_its_own_workers(two_models, tmp_path):
    a, b = two_models
    port = free_port()
    p = spawn("up", ["up", "--model", str(a.path), "--served-model-name", "alpha", "--model", str(b.path),
                     "--colocated", "--no-redis", "--no-kv-store", "--port", str(port), "--kv-cache-gb", "0.01"],
              tmp_path)
    base = f"http://127.0.0.1:{port}"
    try:
        p.wait_for("splitfire is ready", timeout=180)
        prompts = [[(7 * j + 31 * i) % 300 + 3 for j in range(n)] for i, n in enumerate((5, 23))]
        async with aiohttp.ClientSession() as s:
            for name, model in (("alpha", a), ("qwen-b", b)):
                for prompt in prompts:
                    status, out = await _post(s, f"{base}/v1/completions", {
                        "model": name, "prompt": prompt, "max_tokens": N, "temperature": 0, "ignore_eos": True})
                    assert status == 200, out
                    assert out["model"] == name
                    assert out["choices"][0]["text"] == Tokenizer(model.path).decode(model.greedy(prompt, N)), name
            async with s.get(f"{base}/v1/models") as r:
                cards = {c["id"]: c for c in (await r.json())["data"]}
            assert set(cards) == {"alpha", "qwen-b"}
            assert cards["alpha"]["root"] == str(a.path) and cards["alpha"]["max_model_len"] == 512
            assert cards["qwen-b"]["root"] == str(b.path) and cards["qwen-b"]["max_model_len"] == 1024
            status, out = await _post(s, f"{base}/tokenize", {"model": "qwen-b", "prompt": "t5 t6"})
            assert status == 200 and out["max_model_len"] == 1024
            status, out = await _post(s, f"{base}/v1/completions", {"model": "gamma", "prompt": [5], "max_tokens": 1})
            assert status == 404 and "alpha" in out["error"]["message"] and "qwen-b" in out["error"]["message"]
            # A prompt longer than the smaller model's context is refused for it, not for the other.
            long = [j % 390 + 3 for j in range(600)]
            status, out = await _post(s, f"{base}/v1/completions", {"model": "alpha", "prompt": long, "max_tokens": 1})
            assert status == 400, out
            status, out = await _post(s, f"{base}/v1/completions", {"model": "qwen-b", "prompt": long,
                                                                     "max_tokens": 1})
            assert status == 200, out
            # Runtime LoRA loading must say which base model the adapter is for.
            status, out = await _post(s, f"{base}/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere"})
            assert status == 400 and out["error"]["param"] == "model"
        log = p.log()
        assert log.count("worker ready") >= 2
    finally:
        p.popen.send_signal(signal.SIGTERM)
        assert p.popen.wait(60) == 0, p.log()[-3000:]


async def test_each_model_takes_the_names_and_adapters_given_after_it(two_models, tmp_path):
    """`up --model A --lora-modules a1=DIR --model B --served-model-name bee --lora-modules b1=DIR`: each
    model's workers load its own adapters (peft's tokens for each), each adapter's card names its base."""
    from test_lora import TARGETS, _peft_model, peft_greedy

    a, b = two_models
    pa = _peft_model(str(a.path), str(tmp_path / "a1"), 3, 8, False, tuple(TARGETS))
    pb = _peft_model(str(b.path), str(tmp_path / "b1"), 4, 8, False, tuple(TARGETS))
    port = free_port()
    p = spawn("up", ["up", "--model", str(a.path), "--lora-modules", f"a1={tmp_path / 'a1'}", "--model", str(b.path),
                     "--served-model-name", "bee", "--lora-modules", f"b1={tmp_path / 'b1'}", "--colocated",
                     "--no-redis", "--no-kv-store", "--port", str(port), "--kv-cache-gb", "0.01"], tmp_path)
    base = f"http://127.0.0.1:{port}"
    prompt = [(7 * j) % 300 + 3 for j in range(11)]
    try:
        p.wait_for("splitfire is ready", timeout=180)
        async with aiohttp.ClientSession() as s:
            for name, model, want in (("a1", a, peft_greedy(pa, prompt, N)), ("b1", b, peft_greedy(pb, prompt, N)),
                                      ("bee", b, b.greedy(prompt, N)), ("llama-a", a, a.greedy(prompt, N))):
                status, out = await _post(s, f"{base}/v1/completions", {
                    "model": name, "prompt": prompt, "max_tokens": N, "temperature": 0, "ignore_eos": True})
                assert status == 200, out
                assert out["choices"][0]["text"] == Tokenizer(model.path).decode(want), name
            async with s.get(f"{base}/v1/models") as r:
                cards = {c["id"]: c for c in (await r.json())["data"]}
            assert set(cards) == {"llama-a", "bee", "a1", "b1"}
            assert cards["a1"]["parent"] == "llama-a" and cards["b1"]["parent"] == "bee"
    finally:
        p.popen.send_signal(signal.SIGTERM)
        assert p.popen.wait(60) == 0, p.log()[-3000:]


def test_up_gives_each_model_the_flags_after_it():
    import argparse

    from splitfire_cli.supervisor import add_subcommand

    parser = argparse.ArgumentParser()
    add_subcommand(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["up", "--lora-modules", "x=/x", "--model", "A", "--served-model-name", "a",
                              "--lora-modules", "y=/y", "--model", "B", "--lora-modules", "z=/z", "w=/w"])
    assert args.served_names == {0: "a"}
    assert args.lora_by_model == {0: ["x=/x", "y=/y"], 1: ["z=/z", "w=/w"]}
    with pytest.raises(SystemExit):  # two served names for one model
        parser.parse_args(["up", "--model", "A", "--served-model-name", "a", "--served-model-name", "b"])


def test_extra_model_flags_are_validated():
    from router.core.config import RouterConfig

    with pytest.raises(ValueError, match="NAME=MODEL"):
        RouterConfig(model="m", extra_models=["nameonly"]).validate()
    with pytest.raises(ValueError, match="must differ"):
        RouterConfig(model="m", served_model_name="x", extra_models=["x=/m2"]).validate()
    with pytest.raises(ValueError, match="needs --model"):
        RouterConfig(extra_models=["x=/m2"]).validate()
