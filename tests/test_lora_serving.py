"""LoRA adapters through a router, `peft` as the oracle: a request names an adapter as its model; /v1/models
lists adapters with their base; adapters load and unload at run time (vLLM's routes) from under the
workers' --lora-root only; bad adapters are a 400 naming the problem; prefill and decode workers both
apply the adapter."""

from __future__ import annotations

import asyncio
import shutil
import urllib.request

import aiohttp
import pytest
from grpc_client import wait_blocks_free
from procs import address, base_url, start_router, start_worker
from test_lora import adapter, peft_greedy, prompt

from common.tokenizer import Tokenizer

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from hf_models import make_hf_model

    return make_hf_model("llama3", tmp_path_factory.mktemp("base") / "model")


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-root")
    out = {}
    for name, seed, r in (("one", 1, 8), ("two", 2, 4)):
        path, pm = adapter(base, tmp_path_factory, name, seed=seed, r=r)
        shutil.copytree(path, root / name)
        out[name] = (root / name, pm)
    return root, out


async def complete(router, model: str, ids: list[int], n: int = 8) -> tuple[int, str]:
    body = {"model": model, "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    async with aiohttp.ClientSession() as s, s.post(base_url(router) + "/v1/completions", json=body) as r:
        data = await r.json()
        return r.status, (data["choices"][0]["text"] if r.status == 200 else data["error"]["message"])


async def post(router, path: str, body: dict) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.post(base_url(router) + path, json=body) as r:
        return r.status, await r.text()


async def model_cards(router) -> dict[str, dict]:
    async with aiohttp.ClientSession() as s, s.get(base_url(router) + "/v1/models") as r:
        return {m["id"]: m for m in (await r.json())["data"]}


async def test_adapters_served_loaded_and_unloaded_through_the_router(base, adapters, tmp_path):
    root, made = adapters
    (one_dir, pm1), (two_dir, pm2) = made["one"], made["two"]
    tok = Tokenizer(base.path)
    worker = start_worker("both", base.path, tmp_path, "--lora-modules", f"one={one_dir}", "--lora-root", str(root),
                          "--max-loras", "2", "--speculative", "off")
    router = start_router(base.path, tmp_path, "--served-model-name", "base", "--colocated", address(worker),
                          "--health-interval", "0.5")
    try:
        for _ in range(100):
            if "one" in await model_cards(router):
                break
            await asyncio.sleep(0.1)
        cards = await model_cards(router)
        assert cards["one"]["parent"] == "base" and cards["base"]["parent"] is None
        ids = {m: prompt(i, n) for i, (m, n) in enumerate((("base", 20), ("one", 33)))}
        got = await asyncio.gather(*(complete(router, m, p) for m, p in ids.items()))
        assert got[0] == (200, tok.decode(base.greedy(ids["base"], 8)))
        assert got[1] == (200, tok.decode(peft_greedy(pm1, ids["one"], 8)))

        # Run-time loading: only from under --lora-root; a bad adapter is a 400 naming the problem.
        outside = tmp_path / "outside"
        shutil.copytree(two_dir, outside)
        status, text = await post(router, "/v1/load_lora_adapter", {"lora_name": "two", "lora_path": str(outside)})
        assert status == 400 and "outside the adapter roots" in text
        (root / "broken").mkdir()
        (root / "broken" / "adapter_config.json").write_text('{"r": 64, "lora_alpha": 8}')
        status, text = await post(router, "/v1/load_lora_adapter", {"lora_name": "broken",
                                                                    "lora_path": str(root / "broken")})
        assert status == 400 and "above --max-lora-rank" in text
        status, text = await post(router, "/v1/load_lora_adapter", {"lora_name": "two", "lora_path": str(two_dir),
                                                                    "extra": 1})
        assert status == 400 and "extra" in text
        status, text = await post(router, "/v1/load_lora_adapter", {"lora_name": "two", "lora_path": str(two_dir)})
        assert status == 200, text
        assert (await model_cards(router))["two"]["parent"] == "base"
        p2 = prompt(9, 25)
        assert await complete(router, "two", p2) == (200, tok.decode(peft_greedy(pm2, p2, 8)))
        assert await complete(router, "one", ids["one"]) == got[1]  # the others unaffected

        status, _ = await post(router, "/v1/unload_lora_adapter", {"lora_name": "two"})
        assert status == 200
        status, text = await complete(router, "two", p2)
        assert status == 404 and "does not exist" in text
        assert "two" not in await model_cards(router)
        await wait_blocks_free(address(worker))
        body = urllib.request.urlopen(f"http://127.0.0.1:{worker.ports['metrics']}/metrics", timeout=5).read().decode()
        lines = {line for line in body.splitlines() if line.startswith("splitfire_worker_adapter")}
        want = {'splitfire_worker_adapter_requests_total{adapter="one",role="both"} 2.0',
                'splitfire_worker_adapter_requests_total{adapter="two",role="both"} 1.0',
                'splitfire_worker_adapter_tokens_total{adapter="two",kind="completion",role="both"} 8.0',
                'splitfire_worker_adapter_loads_total{op="ok",role="both"} 1.0',
                'splitfire_worker_adapter_loads_total{op="refused",role="both"} 2.0',
                'splitfire_worker_adapter_loads_total{op="unloaded",role="both"} 1.0',
                'splitfire_worker_adapters_resident{role="both"} 1.0'}
        assert want <= lines, sorted(x for x in lines if "bucket" not in x)
        async with aiohttp.ClientSession() as s, s.get(base_url(router) + "/metrics") as r:
            rbody = await r.text()
        for line in ('splitfire_router_model_requests_total{model="one"} 2.0',
                     'splitfire_router_model_requests_total{model="two"} 1.0',  # (the 404 after unloading: not served)
                     'splitfire_router_model_requests_total{model="base"} 1.0',
                     'splitfire_router_model_tokens_total{kind="completion",model="two"} 8.0'):
            assert line in rbody, [x for x in rbody.splitlines() if "model_" in x]
    finally:
        router.stop()
        worker.stop()


async def test_prefill_and_decode_workers_both_apply_the_adapter(base, adapters, tmp_path):
    _, made = adapters
    one_dir, pm1 = made["one"]
    tok = Tokenizer(base.path)
    lora = ("--lora-modules", f"one={one_dir}")
    pre = start_worker("prefill", base.path, tmp_path, *lora)
    dec = start_worker("decode", base.path, tmp_path, *lora, "--local-prefill-max-tokens", "0")  # (ngram drafts)
    router = start_router(base.path, tmp_path, "--served-model-name", "base", "--prefill", address(pre),
                          "--decode", address(dec), "--health-interval", "0.5")
    try:
        for _ in range(100):
            if "one" in await model_cards(router):
                break
            await asyncio.sleep(0.1)
        p = prompt(5, 70)
        assert await complete(router, "one", p) == (200, tok.decode(peft_greedy(pm1, p, 8)))
        assert await complete(router, "base", p) == (200, tok.decode(base.greedy(p, 8)))
        assert "prefill_decision" in dec.log() and "remote=True" in dec.log()
    finally:
        router.stop()
        pre.stop()
        dec.stop()
