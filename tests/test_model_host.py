"""Several base models in one worker (`--on-demand-model`): the hosting policy on plain objects (LRU
eviction, limits, busy models never evicted, one load per model), then real workers: every model answers
with its own transformers tokens, a third model evicts the least recently used one, whose next request
reloads it, and a router in front routes by `model` and prefers workers where it is loaded."""

from __future__ import annotations

import asyncio
import re
import signal

import aiohttp
import grpc
import pytest
from grpc_client import generate, greedy
from hf_models import make_hf_model
from procs import address, free_port, spawn, start_worker

from common.errors import RequestError
from common.tokenizer import Tokenizer
from protos import splitfire_pb2 as pb
from protos import splitfire_pb2_grpc as pbg
from worker.model_host import HostedModel, HostLimits, ModelHost, ModelUnavailable

GIB = 2**30


def make_host(limits: HostLimits, sizes: dict[str, int]) -> tuple[ModelHost, list[tuple[str, str]]]:
    events: list[tuple[str, str]] = []

    async def load(m: HostedModel) -> tuple[object, int]:
        await asyncio.sleep(0.01)
        events.append(("load", m.name))
        return object(), sizes[m.name]

    async def unload(m: HostedModel) -> None:
        events.append(("evict", m.name))
        m.resident = None

    first = HostedModel("a", "/a", resident=object(), footprint=sizes["a"], pinned=True)
    models = [first, *(HostedModel(n, f"/{n}") for n in sizes if n != "a")]
    return ModelHost(models, limits, load, unload, lambda m: sizes[m.name]), events


async def use(host: ModelHost, name: str) -> None:
    host.release(await host.acquire(name))


async def test_least_recently_used_idle_model_is_evicted_and_the_first_never():
    host, events = make_host(HostLimits(max_loaded=3), {"a": GIB, "b": GIB, "c": GIB, "d": GIB})
    for name in ("b", "c", "a", "b", "d"):  # c is now the least recently used of the evictable ones
        await use(host, name)
    assert events == [("load", "b"), ("load", "c"), ("evict", "c"), ("load", "d")]
    assert sorted(host.resident()) == ["a", "b", "d"]
    await use(host, "c")  # back: b is now the least recently used (a is pinned)
    assert events[-2:] == [("evict", "b"), ("load", "c")]
    assert host.models["c"].loads == 2


async def test_the_memory_budget_evicts_as_many_as_it_takes_and_refuses_a_model_that_never_fits():
    host, events = make_host(HostLimits(memory_bytes=4 * GIB), {"a": GIB, "b": GIB, "c": GIB, "d": 3 * GIB,
                                                                "e": 5 * GIB})
    for name in ("b", "c", "d"):
        await use(host, name)
    assert events == [("load", "b"), ("load", "c"), ("evict", "b"), ("evict", "c"), ("load", "d")]
    with pytest.raises(ModelUnavailable, match=r"needs 5\.00 GiB.*--model-memory-gb 4\.00"):
        await host.acquire("e")
    with pytest.raises(RequestError, match="not served by this worker"):
        await host.acquire("zzz")


async def test_a_busy_model_is_never_evicted_the_request_waits_for_room_or_gives_up():
    host, events = make_host(HostLimits(max_loaded=2, wait_s=0.3), {"a": GIB, "b": GIB, "c": GIB})
    b = await host.acquire("b")  # in use
    with pytest.raises(ModelUnavailable, match="every resident model is busy"):
        await host.acquire("c")
    assert ("evict", "b") not in events
    waiter = asyncio.create_task(host.acquire("c"))
    await asyncio.sleep(0.05)
    host.release(b)  # b goes idle: c's request evicts it and loads c
    c = await waiter
    assert events[-2:] == [("evict", "b"), ("load", "c")] and c.active == 1


async def test_a_model_that_fails_to_load_fails_its_request_by_name_and_leaves_the_others():
    host, _ = make_host(HostLimits(max_loaded=3), {"a": GIB, "b": GIB, "c": GIB})

    async def broken(m: HostedModel) -> tuple[object, int]:
        if m.name == "c":
            raise OSError("truncated safetensors header")
        return object(), GIB

    host._load = broken
    await use(host, "b")
    with pytest.raises(ModelUnavailable, match="'c' could not be loaded: OSError: truncated"):
        await host.acquire("c")
    assert sorted(host.resident()) == ["a", "b"] and host.models["c"].resident is None
    await use(host, "b")


async def test_a_model_being_evicted_takes_no_request_until_it_is_loaded_again():
    """Loading d evicts b and then c; a request for c arriving while b goes must not get the c that is about
    to be freed: it waits, and gets c loaded again once d's request is done."""
    host, events = make_host(HostLimits(memory_bytes=3 * GIB, wait_s=5), {"a": GIB, "b": GIB, "c": GIB,
                                                                           "d": 2 * GIB})
    await use(host, "b")
    await use(host, "c")
    slow = host._unload

    async def unload(m: HostedModel) -> None:
        await asyncio.sleep(0.05)
        await slow(m)

    host._unload = unload
    loading_d = asyncio.create_task(host.acquire("d"))
    await asyncio.sleep(0.02)  # b is being evicted, c is next
    assert host.models["c"].evicting
    wants_c = asyncio.create_task(host.acquire("c"))
    d = await loading_d
    await asyncio.sleep(0.1)
    assert not wants_c.done()  # no room for c while d is in use
    host.release(d)
    c = await wants_c
    assert c.loads == 2 and c.resident is not None and not c.evicting
    assert events == [("load", "b"), ("load", "c"), ("evict", "b"), ("evict", "c"), ("load", "d"), ("evict", "d"),
                      ("load", "c")]


async def test_concurrent_requests_for_a_missing_model_load_it_once():
    host, events = make_host(HostLimits(max_loaded=2), {"a": GIB, "b": GIB})
    got = await asyncio.gather(*(host.acquire("b") for _ in range(5)))
    assert events == [("load", "b")] and got[0].active == 5


# -- real workers -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def three_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hosted")
    return (make_hf_model("llama3", root / "llama-a", seed=1),
            make_hf_model("qwen3", root / "qwen-b", seed=2),
            make_hf_model("llama3", root / "llama-c", seed=3))


def metric(log_text: str, event: str, model: str) -> int:
    return len(re.findall(rf"event={event} model={re.escape(model)}\b", log_text))


async def test_one_worker_serves_three_models_loading_on_demand_and_evicting_the_least_recently_used(
        three_models, tmp_path):
    import shutil

    a, b, c = three_models
    broken = tmp_path / "broken"  # a checkpoint cut short: its load fails, nothing else does
    shutil.copytree(c.path, broken)
    for f in broken.glob("*.safetensors"):
        f.write_bytes(f.read_bytes()[:100])
    w = start_worker("both", a.path, tmp_path, "--on-demand-model", str(b.path), "--on-demand-model", str(c.path),
                     "--on-demand-model", str(broken), "--max-loaded-models", "2", name="host")
    try:
        async with grpc.aio.insecure_channel(address(w)) as ch:
            health = await pbg.WorkerStub(ch).Health(pb.HealthRequest())
        assert list(health.models) == ["llama-a", "qwen-b", "llama-c", "broken"]
        assert list(health.resident) == ["llama-a"]
        prompt = [(7 * j) % 300 + 3 for j in range(20)]
        # The first model, then b (loaded), then c (loaded: b, the least recently used, evicted), then b again.
        for model, name in ((a, ""), (b, "qwen-b"), (c, "llama-c"), (b, "qwen-b"), (a, "llama-a")):
            out = await generate(address(w), prompt, greedy(6), model=name)
            assert out.token_ids == model.greedy(prompt, 6), name
        log = w.log()
        assert metric(log, "model_loaded", "qwen-b") == 2 and metric(log, "model_loaded", "llama-c") == 1
        assert metric(log, "model_evicted", "qwen-b") == 1 and metric(log, "model_evicted", "llama-c") == 1
        assert "event=model_freed model=qwen-b freed=True" in log  # its engine is gone, not just unreferenced
        assert metric(log, "model_evicted", "llama-a") == 0  # the first model stays
        async with grpc.aio.insecure_channel(address(w)) as ch:
            health = await pbg.WorkerStub(ch).Health(pb.HealthRequest())
            assert sorted(health.resident) == ["llama-a", "qwen-b"]
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await generate(address(w), prompt, greedy(2), model="nope")
            assert e.value.code() == grpc.StatusCode.NOT_FOUND and "llama-c" in e.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await generate(address(w), prompt, greedy(2), model="broken")
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "'broken' could not be loaded" in e.value.details()
        # Both models' requests in flight at once, each on its own engine.
        outs = await asyncio.gather(*(generate(address(w), prompt, greedy(6), model=n) for n in ("llama-a", "qwen-b")))
        assert [o.token_ids for o in outs] == [a.greedy(prompt, 6), b.greedy(prompt, 6)]
    finally:
        assert w.stop() == 0, w.log()[-2000:]


def test_hosting_flags_are_validated(tiny_model_dir, tmp_path):
    from worker.config import WorkerConfig

    cfg = WorkerConfig("both", max_loaded_models=2)
    with pytest.raises(ValueError, match="add --on-demand-model"):
        cfg.validate()
    with pytest.raises(ValueError, match="colocated workers"):
        WorkerConfig("decode", on_demand_models=[str(tiny_model_dir)]).validate()
    with pytest.raises(ValueError, match="no room beside the first model"):
        WorkerConfig("both", on_demand_models=[str(tiny_model_dir)], max_loaded_models=1).validate()


async def test_splitfire_up_shared_workers_route_by_model_and_prefer_where_it_is_loaded(three_models, tmp_path):
    a, b, c = three_models
    port = free_port()
    p = spawn("up", ["up", "--model", str(a.path), "--model", str(b.path), "--model", str(c.path),
                     "--shared-workers", "2", "--max-loaded-models", "2", "--no-redis", "--no-kv-store",
                     "--port", str(port), "--kv-cache-gb", "0.01", "--router-arg=--health-interval=0.2"], tmp_path)
    base = f"http://127.0.0.1:{port}"
    try:
        p.wait_for("splitfire is ready", timeout=180)
        prompt = [(5 * j) % 300 + 3 for j in range(12)]
        async with aiohttp.ClientSession() as s:
            for _ in range(2):
                for name, model in (("llama-a", a), ("qwen-b", b), ("llama-c", c)):
                    async with s.post(f"{base}/v1/completions", json={
                            "model": name, "prompt": prompt, "max_tokens": 5, "temperature": 0,
                            "ignore_eos": True}) as r:
                        body = await r.json()
                        assert r.status == 200, body
                        assert body["choices"][0]["text"] == Tokenizer(model.path).decode(model.greedy(prompt, 5))
                        assert body["model"] == name
                await asyncio.sleep(0.6)  # the routers' health checks see where each model is loaded now
            async with s.get(f"{base}/v1/models") as r:
                assert {m["id"] for m in (await r.json())["data"]} == {"llama-a", "qwen-b", "llama-c"}
        log = p.log()
        # Worker 0 keeps llama-a and worker 1 qwen-b resident: each of those is served where it is loaded
        # (no load of either), and llama-c is loaded once, on one of them (the router then prefers it there).
        assert "event=model_loaded model=llama-a" not in log and "event=model_loaded model=qwen-b" not in log
        assert log.count("event=model_loaded model=llama-c") == 1
    finally:
        p.popen.send_signal(signal.SIGTERM)
        assert p.popen.wait(60) == 0, p.log()[-3000:]


async def test_a_worker_asked_for_a_model_it_does_not_serve_answers_not_found(tiny_model_dir, tmp_path):
    w = start_worker("both", tiny_model_dir, tmp_path, name="one-model")
    try:
        ok = await generate(address(w), [5, 6, 7], greedy(2), model=tiny_model_dir.name)
        assert len(ok.token_ids) == 2
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await generate(address(w), [5, 6, 7], greedy(2), model="another")
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and tiny_model_dir.name in e.value.details()
    finally:
        assert w.stop() == 0


async def test_adapters_of_a_model_loaded_on_demand_survive_its_eviction(three_models, tmp_path):
    """`POST /v1/load_lora_adapter` naming a model loaded on demand: the worker makes it resident, places the
    adapter, and places it again each time the model is loaded after an eviction; requests under it equal
    peft; /v1/models names its parent; unloaded, it is gone (404) and not placed again."""
    import shutil

    from test_lora import TARGETS, _peft_model, peft_greedy

    a, b, c = three_models
    root = tmp_path / "adapters"
    pm = _peft_model(str(b.path), str(root / "b-ad"), 7, 16, False, tuple(TARGETS))
    port = free_port()
    p = spawn("up", ["up", "--model", str(a.path), "--model", str(b.path), "--model", str(c.path),
                     "--shared-workers", "1", "--max-loaded-models", "2", "--lora-root", str(root), "--no-redis",
                     "--no-kv-store", "--port", str(port), "--kv-cache-gb", "0.01",
                     "--router-arg=--health-interval=0.2"], tmp_path)
    base = f"http://127.0.0.1:{port}"
    prompt = [(5 * j) % 300 + 3 for j in range(12)]
    want = Tokenizer(b.path).decode(peft_greedy(pm, prompt, 5))
    assert want != Tokenizer(b.path).decode(b.greedy(prompt, 5))  # (the adapter matters)

    async def complete(s: aiohttp.ClientSession, model: str) -> tuple[int, dict]:
        async with s.post(f"{base}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 5,
                                                          "temperature": 0, "ignore_eos": True}) as r:
            return r.status, await r.json()

    try:
        p.wait_for("splitfire is ready", timeout=180)
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{base}/v1/load_lora_adapter", json={
                    "model": "qwen-b", "lora_name": "b-ad", "lora_path": str(root / "b-ad")}) as r:
                assert r.status == 200, await r.text()
            async with s.post(f"{base}/v1/load_lora_adapter", json={  # (another base's name: refused by name)
                    "model": "llama-c", "lora_name": "b-ad", "lora_path": str(root / "b-ad")}) as r:
                assert r.status == 400 and "b-ad" in (await r.json())["error"]["message"]
            for model in ("b-ad", "llama-c", "llama-a", "b-ad"):  # llama-c evicts qwen-b; b-ad loads it again
                status, body = await complete(s, model)
                assert status == 200, body
                if model == "b-ad":
                    assert body["choices"][0]["text"] == want
            async with s.get(f"{base}/v1/models") as r:
                cards = {m["id"]: m for m in (await r.json())["data"]}
            assert cards["b-ad"]["parent"] == "qwen-b"
            async with s.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "b-ad"}) as r:
                assert r.status == 200, await r.text()
            status, body = await complete(s, "b-ad")
            assert status == 404, body
            # An adapter whose files break while its model is evicted: the reload drops it, by name, in the log.
            shutil.copytree(root / "b-ad", root / "b-gone")
            async with s.post(f"{base}/v1/load_lora_adapter", json={
                    "model": "qwen-b", "lora_name": "b-gone", "lora_path": str(root / "b-gone")}) as r:
                assert r.status == 200, await r.text()
            (root / "b-gone" / "adapter_model.safetensors").write_bytes(b"not safetensors")
            assert (await complete(s, "llama-c"))[0] == 200  # (qwen-b evicted)
            status, body = await complete(s, "b-gone")
            # Refused by name: by the worker that found it broken ("is not loaded"), or — when a health check
            # already carried the worker's adapter list without it to the router — by the router (seen in CI).
            message = body["error"]["message"]
            assert status in (400, 404) and ("'b-gone' is not loaded" in message
                                             or "model 'b-gone' does not exist" in message), body
            assert (await complete(s, "qwen-b"))[0] == 200  # the model itself serves on
            await asyncio.sleep(0.6)
            async with s.get(f"{base}/v1/models") as r:
                assert "b-gone" not in {m["id"] for m in (await r.json())["data"]}
        log = p.log()
        assert "event=lora_reinstall_failed model=qwen-b name=b-gone" in log
        # qwen-b loaded by the first load route, again for b-ad after llama-c evicted it, and for b-gone
        assert log.count("event=model_loaded model=qwen-b") == 3 and log.count("event=model_evicted model=qwen-b") == 2
        # placed by the load route, and again when qwen-b was loaded after its eviction
        assert len(re.findall(r"event=lora_loaded name=b-ad path=\S+ rank=16 slot=0", log)) == 2
    finally:
        p.popen.send_signal(signal.SIGTERM)
        assert p.popen.wait(60) == 0, p.log()[-3000:]
