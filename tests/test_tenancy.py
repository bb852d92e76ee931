"""Tenants isolated in time and capacity: weighted fair admission at the router, fair scheduling and
preemption in the engine, per-key quotas (shared through Redis), scoped keys, reloading keys."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections import Counter

import aiohttp
import openai
import pytest
from engine_helpers import make_engine
from engine_helpers import step_tokens as _step
from procs import address, base_url, start_redis, start_router, start_worker
from reference import Reference

from common.sampling_params import SamplingParams
from router.api.errors import APIError
from router.core.endpoints import EndpointRegistry
from router.core.metrics import RouterMetrics
from router.tenancy.admission import Admission
from router.tenancy.quotas import PipelinedCounters, Quotas, RedisCounters
from router.tenancy.redis_pipe import PipelinedRedis, RedisError
from router.tenancy.tenants import Caller, KeyPolicy, Tenants, key_id, read_keys

MODEL = "tiny"
GREEDY = dict(temperature=0.0, ignore_eos=True)


def _prompt(i: int, n: int = 12) -> list[int]:
    return [(11 * i + 7 * j) % 300 + 3 for j in range(n)]


# -- keys -------------------------------------------------------------------------------------


def test_key_files_in_every_form(tmp_path):
    lines = tmp_path / "lines"
    lines.write_text("# key tenant\nsk-alice alice\nsk-solo-key\n")
    assert read_keys(str(lines)) == {"sk-alice": KeyPolicy("alice"), "sk-solo-key": KeyPolicy("sk-solo-")}
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps({"sk-a": "a"}))
    assert read_keys(str(flat)) == {"sk-a": KeyPolicy("a")}
    full = tmp_path / "full.json"
    full.write_text(json.dumps({"keys": {
        "sk-paid": {"tenant": "paid", "weight": 2, "max_concurrent": 32, "requests_per_minute": 600,
                    "tokens_per_minute": 200000, "models": ["tiny"], "admin": True},
        "sk-free": {"tenant": "free"}}}))
    keys = read_keys(str(full))
    assert keys["sk-paid"] == KeyPolicy("paid", 2.0, 32, 600, 200000, frozenset({"tiny"}), True)
    assert keys["sk-free"] == KeyPolicy("free")
    assert keys["sk-paid"].may_use("tiny") and not keys["sk-paid"].may_use("other") and keys["sk-free"].may_use("x")
    for bad, says in (({"keys": {"k": {"tenant": "a", "wieght": 2}}}, "unknown setting(s) ['wieght']"),
                      ({"keys": {"k": {"weight": 2}}}, "'tenant' (a name) is required"),
                      ({"keys": {"k": {"tenant": "a", "weight": 0}}}, "'weight' must be a positive number"),
                      ({"keys": {"k": {"tenant": "a", "max_concurrent": 1.5}}}, "'max_concurrent' must be a positive"),
                      ({"keys": {"k": {"tenant": "a", "models": "tiny"}}}, "'models' must be a list"),
                      ({"keys": {"k": {"tenant": "a", "admin": "yes"}}}, "'admin' must be true or false"),
                      ({"keys": {}}, "no API keys")):
        f = tmp_path / "bad.json"
        f.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=None) as e:
            read_keys(str(f))
        assert says in str(e.value)
        assert "\"k\"" not in str(e.value) and "key k " not in str(e.value)  # errors name the key's hash


def test_reload_keeps_the_current_keys_when_the_file_breaks(tmp_path, caplog):
    f = tmp_path / "keys.json"
    f.write_text(json.dumps({"keys": {"sk-a": {"tenant": "a"}}}))
    t = Tenants.from_file(str(f))
    assert set(t.keys or {}) == {"sk-a"}
    f.write_text(json.dumps({"keys": {"sk-b": {"tenant": "b", "weight": 3}}}))
    t.reload()
    assert set(t.keys or {}) == {"sk-b"} and t._callers["sk-b"].policy.weight == 3
    f.write_text("{not json")
    with caplog.at_level(logging.ERROR, "splitfire.router"):
        t.reload()
    assert set(t.keys or {}) == {"sk-b"} and "api_keys_reload_failed" in caplog.text
    assert "sk-b" not in caplog.text and key_id("sk-b") != "sk-b"


# -- router admission: weighted fair queuing ---------------------------------------------------


def _admission(capacity: int) -> Admission:
    return Admission(capacity, 1000, 60, RouterMetrics(EndpointRegistry(16)))


async def test_admission_is_weighted_fair_and_never_queues_a_quiet_tenant_behind_a_backlog():
    adm = _admission(1)
    order: list[str] = []
    gate = asyncio.Event()

    async def one(tenant: str, weight: float) -> None:
        async with adm.slot(tenant, weight):
            order.append(tenant)
            await gate.wait()
            gate.clear()

    async def advance() -> None:
        """The slot's holder leaves; wait until the next one holds it."""
        n = len(order)
        gate.set()
        for _ in range(1000):
            if len(order) > n:
                return
            await asyncio.sleep(0)
        raise AssertionError("no grant")

    tasks = [asyncio.create_task(one("a", 2.0))]
    try:
        await asyncio.sleep(0)
        tasks += [asyncio.create_task(one("a", 2.0)) for _ in range(30)]
        tasks += [asyncio.create_task(one("b", 1.0)) for _ in range(15)]
        await asyncio.sleep(0)
        assert adm.waiting == 45 and adm.running == 1
        for _ in range(30):
            await advance()
        # While both are backlogged, a (weight 2) gets two slots for each of b's (within one grant).
        counts = Counter(order[1:31])
        assert abs(counts["a"] - 20) <= 1 and counts["a"] + counts["b"] == 30, order
        # A third tenant arriving behind both backlogs is served next.
        tasks.append(asyncio.create_task(one("c", 1.0)))
        await asyncio.sleep(0)
        await advance()
        assert order[-1] == "c", order[-5:]
        while len(order) < len(tasks):
            await advance()
        gate.set()
        await asyncio.gather(*tasks)
        assert adm.running == 0 and adm.waiting == 0 and not adm.queues
    finally:
        for t in tasks:
            t.cancel()


async def test_admission_with_one_tenant_is_first_come_first_served_and_times_out_cleanly():
    adm = Admission(1, 2, 0.2, RouterMetrics(EndpointRegistry(16)))
    order: list[int] = []
    release = asyncio.Event()

    async def one(i: int) -> None:
        async with adm.slot():
            order.append(i)
            await release.wait()

    first = asyncio.create_task(one(0))
    try:
        await asyncio.sleep(0)
        waiters = [asyncio.create_task(one(i)) for i in (1, 2)]
        await asyncio.sleep(0)
        with pytest.raises(APIError) as e:  # the queue is full
            await one(3)
        # A full fleet, nothing more important in it: 503, not a 429 that blames the caller.
        assert e.value.status == 503 and e.value.code == "no_capacity" and e.value.headers["Retry-After"] == "1"
        with pytest.raises(APIError) as e:  # nobody leaves within the queue timeout
            await asyncio.gather(*waiters)
        assert e.value.status == 503 and e.value.code == "no_capacity"
        assert adm.waiting == 0 and not adm.queues
        release.set()
        await first
        await asyncio.gather(one(4), one(5))
        assert order == [0, 4, 5] and adm.running == 0
    finally:
        first.cancel()


# -- engine: fair scheduling and preemption ----------------------------------------------------


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    return Reference(tiny_model_dir)


def test_quiet_tenant_is_admitted_at_once_and_outputs_stay_exact(tiny_model_dir, ref):
    engine = make_engine(tiny_model_dir, max_num_seqs=4, max_num_batched_tokens=64)
    outs: dict[str, list[int]] = {}
    for i in range(10):
        engine.add_request(f"noisy{i}", _prompt(i), SamplingParams(max_tokens=30, **GREEDY), tenant="noisy")
    for _ in range(3):
        _step(engine, outs)
    assert len(engine.scheduler.running) == 4 and len(engine.scheduler.waiting) == 6
    engine.add_request("quiet", _prompt(99), SamplingParams(max_tokens=5, **GREEDY), tenant="quiet")
    # Its prompt is computed in the next step (a noisy sequence made room): first come, first
    # served would have waited for a noisy request to finish (30 tokens).
    assert "quiet" in _step(engine, outs)
    assert engine.scheduler.num_fair_preemptions == 1
    while engine.has_work:
        _step(engine, outs)
    for i in range(10):
        assert outs[f"noisy{i}"] == ref.greedy(_prompt(i), 30), i
    assert outs["quiet"] == ref.greedy(_prompt(99), 5)


def test_weights_split_a_saturated_batch(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_num_seqs=6, max_num_batched_tokens=64)
    for i in range(20):
        engine.add_request(f"a{i}", _prompt(i), SamplingParams(max_tokens=40, **GREEDY), tenant="a", weight=2.0)
        engine.add_request(f"b{i}", _prompt(i + 50), SamplingParams(max_tokens=40, **GREEDY), tenant="b")
    tokens = Counter[str]()
    held = Counter[str]()
    for _ in range(120):
        for o in engine.step():
            tokens[o.request_id[0]] += len(o.token_ids)
        held.update(s.tenant for s in engine.scheduler.running)
    assert 1.9 <= held["a"] / held["b"] <= 2.1, held
    ratio = tokens["a"] / tokens["b"]
    assert 1.8 <= ratio <= 2.2, tokens


def test_kv_pressure_preempts_the_tenant_most_over_its_share(tiny_model_dir, ref):
    page_bytes = 2 * 16 * 2 * 16 * 4 * 2
    engine = make_engine(tiny_model_dir, kv_cache_gb=11 * page_bytes / 2**30, max_num_batched_tokens=128)
    assert engine.blocks.num_blocks == 11
    # b is admitted first and holds 3 sequences; a holds 1 and arrived last: under FIFO, a's newest
    # would be the one preempted; here b, most over its share, gives up its newest.
    for i in range(3):
        engine.add_request(f"b{i}", _prompt(i, 20), SamplingParams(max_tokens=25, **GREEDY), tenant="b")
    engine.add_request("a0", _prompt(40, 20), SamplingParams(max_tokens=25, **GREEDY), tenant="a")
    preempted: list[str] = []
    outs: dict[str, list[int]] = {}
    while engine.has_work:
        before = {s.request_id: s.num_preemptions for s in engine.seqs.values()}
        _step(engine, outs)
        preempted += [s.request_id for s in engine.seqs.values() if s.num_preemptions > before.get(s.request_id, 0)]
    assert preempted and all(r.startswith("b") for r in preempted), preempted
    for rid, p in [*((f"b{i}", _prompt(i, 20)) for i in range(3)), ("a0", _prompt(40, 20))]:
        assert outs[rid] == ref.greedy(p, 25), rid


# -- quotas ------------------------------------------------------------------------------------


def _caller(**limits) -> Caller:
    return Caller(key_id("sk-q"), KeyPolicy("q", **limits))


@pytest.mark.parametrize("impl", ["redis-py", "pipelined", "both"])
async def test_quotas_trip_exactly_at_their_limits_across_two_replicas(tmp_path, impl):
    """Two replicas' quotas over one Redis: through redis-py (the reference), the pipelined client
    (what the router runs), and one of each — the same answers every time."""
    import redis.asyncio as aioredis

    server = start_redis(tmp_path)
    url = f"redis://127.0.0.1:{server.ports['port']}/0"
    clients = [aioredis.from_url(url) for _ in range(2)]
    pipes = [PipelinedRedis(url) for _ in range(2)]
    kinds = {"redis-py": ["r", "r"], "pipelined": ["p", "p"], "both": ["r", "p"]}[impl]
    replicas = [Quotas(RedisCounters(clients[i]) if k == "r" else PipelinedCounters(pipes[i]))
                for i, k in enumerate(kinds)]
    real_release = Quotas.release

    async def release(self, r, used) -> None:  # the pipelined client sends releases without waiting
        await real_release(self, r, used)
        for pipe in pipes:
            await pipe.drain()

    for q in replicas:
        q.release = release.__get__(q)
    try:
        # Requests per minute: 5 in all, taken alternately through two replicas.
        rpm = _caller(requests_per_minute=5)
        for i in range(5):
            await replicas[i % 2].release(await replicas[i % 2].admit(rpm, 10, 0), 10)
        with pytest.raises(APIError) as e:
            await replicas[1].admit(rpm, 10, 0)
        assert e.value.status == 429 and e.value.param == "requests_per_minute"
        assert 1 <= int(e.value.headers["Retry-After"]) <= 61
        # Tokens per minute: reservations (prompt + max_tokens) reconciled to what was used.
        tpm = Caller(key_id("sk-t"), KeyPolicy("t", tokens_per_minute=100))
        r1 = await replicas[0].admit(tpm, 20, 50)  # 70 reserved
        with pytest.raises(APIError) as e:
            await replicas[1].admit(tpm, 20, 20)  # 110 > 100
        assert e.value.param == "tokens_per_minute"
        await replicas[0].release(r1, 20 + 10)  # used 30: 70 - 30 = 40 given back
        r2 = await replicas[1].admit(tpm, 20, 50)  # 30 + 70 = 100: exactly at the limit
        with pytest.raises(APIError):
            await replicas[0].admit(tpm, 1, 0)  # 101
        await replicas[1].release(r2, 70)
        with pytest.raises(APIError) as e:  # one request alone over the limit: says so
            await replicas[0].admit(tpm, 60, 60)
        assert "more than the key's limit of 100" in e.value.message
        # Concurrent streams: the third is refused with Retry-After 1, a freed slot admits again.
        conc = Caller(key_id("sk-c"), KeyPolicy("c", max_concurrent=2))
        held = [await replicas[0].admit(conc, 1, 0), await replicas[1].admit(conc, 1, 0)]
        with pytest.raises(APIError) as e:
            await replicas[0].admit(conc, 1, 0)
        assert e.value.param == "max_concurrent" and e.value.headers["Retry-After"] == "1"
        await replicas[1].release(held.pop(), 1)
        held.append(await replicas[0].admit(conc, 1, 0))
        # A refused request takes nothing: the refusals above left the counters where they were.
        assert int(await clients[0].get(f"splitfire:quota:streams:{conc.key_id}")) == 2
        for r in held:
            await replicas[0].release(r, 1)
        assert int(await clients[0].get(f"splitfire:quota:streams:{conc.key_id}")) == 0
        # Redis gone: each replica counts alone (logged), never without limits.
        server.stop()
        solo = _caller(max_concurrent=1)
        kept = await replicas[0].admit(solo, 1, 0)
        assert replicas[0].degraded and kept is not None and not kept.shared
        with pytest.raises(APIError):
            await replicas[0].admit(solo, 1, 0)
        await replicas[0].release(kept, 1)
        await replicas[0].release(await replicas[0].admit(solo, 1, 0), 1)
    finally:
        for c in clients:
            await c.aclose()
        for pipe in pipes:
            await pipe.aclose()
        server.stop()


# -- through the router ------------------------------------------------------------------------


def _keys(tmp_path, keys: dict) -> str:
    f = tmp_path / "keys.json"
    f.write_text(json.dumps({"keys": keys}))
    return str(f)


async def _post(url: str, key: str, body: dict, path: str = "/v1/chat/completions") -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body,
                                                    headers={"Authorization": f"Bearer {key}"}) as r:
        return r.status, dict(r.headers), await r.json(content_type=None)


def _chat(model: str = MODEL, max_tokens: int = 3) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}


def _oai(max_tokens: int) -> dict:
    """`_chat` for the openai client (our extensions go in extra_body)."""
    body = _chat(max_tokens=max_tokens)
    return {**{k: v for k, v in body.items() if k != "ignore_eos"}, "extra_body": {"ignore_eos": True}}


async def test_scoped_keys_quotas_and_reload_through_the_router(tiny_model_dir, tmp_path):
    path = _keys(tmp_path, {
        "sk-admin": {"tenant": "ops", "admin": True},
        "sk-scoped": {"tenant": "s", "models": ["elsewhere"]},
        "sk-one": {"tenant": "one", "max_concurrent": 1},
        "sk-rpm": {"tenant": "r", "requests_per_minute": 2},
    })
    worker = start_worker("both", tiny_model_dir, tmp_path)
    router = start_router(tiny_model_dir, tmp_path, "--served-model-name", MODEL, "--colocated", address(worker),
                          "--api-keys", path, "--enable-cache-reset")
    url = base_url(router)
    try:
        # Scopes: a model outside the key's list is a 404 that names only what it may use.
        status, _, body = await _post(url, "sk-scoped", _chat())
        assert status == 404 and body["error"]["code"] == "model_not_found"
        assert body["error"]["message"] == "model 'tiny' does not exist; available: []"
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/v1/models", headers={"Authorization": "Bearer sk-scoped"}) as r:
                assert (await r.json())["data"] == []
            async with s.get(url + "/v1/models/tiny", headers={"Authorization": "Bearer sk-scoped"}) as r:
                assert r.status == 404
            async with s.get(url + "/v1/models", headers={"Authorization": "Bearer sk-one"}) as r:
                assert [m["id"] for m in (await r.json())["data"]] == [MODEL]
        status, _, body = await _post(url, "sk-scoped", {"model": MODEL, "prompt": "hi"}, "/tokenize")
        assert status == 404
        # Admin routes: refused to other keys, allowed to admin ones.
        status, _, body = await _post(url, "sk-one", {}, "/reset_prefix_cache")
        assert status == 403 and body["error"]["code"] == "admin_only"
        assert (await _post(url, "sk-admin", {}, "/reset_prefix_cache"))[0] == 200
        # Requests per minute: the third within the minute is a 429 naming the limit.
        assert (await _post(url, "sk-rpm", _chat()))[0] == 200
        assert (await _post(url, "sk-rpm", _chat()))[0] == 200
        status, headers, body = await _post(url, "sk-rpm", _chat())
        assert status == 429 and body["error"]["param"] == "requests_per_minute" and int(headers["Retry-After"]) >= 1
        # Concurrency: while one stream runs, a second request is a 429 with Retry-After 1; the
        # official client retries after it and gets through once the stream is done.
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-one", max_retries=8)
        async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions",
                                                        json={**_chat(max_tokens=900), "stream": True},
                                                        headers={"Authorization": "Bearer sk-one"}) as r:
            assert r.status == 200
            await r.content.readline()  # the stream is under way
            status, headers, body = await _post(url, "sk-one", _chat())
            assert status == 429 and body["error"]["param"] == "max_concurrent" and headers["Retry-After"] == "1"
            retried = asyncio.create_task(client.chat.completions.create(**_oai(3)))
            rest = await r.read()
        assert b"[DONE]" in rest
        assert (await retried).usage.completion_tokens == 3
        # Reload (SIGHUP) while a stream is running: the stream finishes, the old key is gone,
        # the new one works.
        stream = asyncio.create_task(client.chat.completions.create(**_oai(900)))
        await asyncio.sleep(0.2)
        _keys(tmp_path, {"sk-new": {"tenant": "one"}, "sk-admin": {"tenant": "ops", "admin": True}})
        router.popen.send_signal(signal.SIGHUP)
        router.wait_for("event=api_keys_reloaded", timeout=10)
        assert (await stream).usage.completion_tokens == 900
        assert (await _post(url, "sk-one", _chat()))[0] == 401
        assert (await _post(url, "sk-new", _chat()))[0] == 200
        await client.close()
        # Per-tenant metrics; keys never in the log.
        async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
            text = await r.text()
        assert 'splitfire_tenant_throttled_total{limit="requests_per_minute",tenant="r"} 1.0' in text
        # The client's first try was refused too: it retried.
        conc = text.split('splitfire_tenant_throttled_total{limit="max_concurrent",tenant="one"} ')[1]
        assert float(conc.split()[0]) >= 2
        assert 'splitfire_tenant_requests_total{tenant="one"}' in text
        assert 'splitfire_tenant_tokens_total{kind="completion",tenant="r"} 6.0' in text
        assert 'splitfire_tenant_queue_seconds_count{tenant="one"}' in text
        log = router.log()
        assert "event=request_throttled" in log and not any(k in log for k in ("sk-rpm", "sk-one", "sk-admin"))
    finally:
        router.stop()
        worker.stop()


async def test_keys_file_watch_picks_up_a_new_file(tiny_model_dir, tmp_path):
    path = _keys(tmp_path, {"sk-a": {"tenant": "a"}})
    worker = start_worker("both", tiny_model_dir, tmp_path)
    router = start_router(tiny_model_dir, tmp_path, "--served-model-name", MODEL, "--colocated", address(worker),
                          "--api-keys", path)
    try:
        assert (await _post(base_url(router), "sk-b", _chat()))[0] == 401
        time.sleep(0.05)
        _keys(tmp_path, {"sk-a": {"tenant": "a"}, "sk-b": {"tenant": "b"}})  # as a Secret update would
        router.wait_for("event=api_keys_reloaded", timeout=10)
        assert (await _post(base_url(router), "sk-b", _chat()))[0] == 200
    finally:
        router.stop()
        worker.stop()


async def test_pipelined_redis_client_orders_replies_reloads_scripts_and_reconnects(tmp_path):
    server = start_redis(tmp_path)
    port = server.ports["port"]
    pipe = PipelinedRedis(f"redis://127.0.0.1:{port}/3", timeout_s=1.0, retry_s=0.5)
    try:
        # Many calls in flight at once: each gets its own reply, in order, off one connection.
        got = await asyncio.gather(*(pipe.call("INCRBY", f"k{i}", i + 1) for i in range(300)))
        assert got == list(range(1, 301))
        assert await pipe.call("GET", "k9") == b"10" and await pipe.call("GET", "nothing") is None
        with pytest.raises(RedisError, match="WRONGTYPE"):
            await pipe.call("LPUSH", "k1", "x")
        # Database 3 was selected: database 0 has none of it.
        import redis.asyncio as aioredis

        other = aioredis.from_url(f"redis://127.0.0.1:{port}/0")
        assert await other.get("k9") is None
        await other.aclose()
        # A script Redis has forgotten (a restart, SCRIPT FLUSH) is loaded again.
        sha = pipe.script("return tonumber(ARGV[1]) * 2")
        assert await pipe.evalsha(sha, [], [21]) == 42
        await pipe.call("SCRIPT", "FLUSH")
        assert await pipe.evalsha(sha, [], [5]) == 10
        # Redis gone: calls fail with ConnectionError, at once while the retry interval lasts.
        server.stop()
        with pytest.raises(ConnectionError):
            await pipe.call("PING")
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match="failed under"):
            await pipe.call("PING")
        assert time.monotonic() - t0 < 0.05
        # Back on the same port: the next call after the interval reconnects.
        server = start_redis(tmp_path, port)
        await asyncio.sleep(0.6)
        assert await pipe.call("PING") == "PONG"
    finally:
        await pipe.aclose()
        server.stop()
