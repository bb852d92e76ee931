"""Operating the router: workers found through Redis self-registration, admission control
(429 + Retry-After), API keys (401) that scope tenants, health-check ejection and re-admission."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
from procs import ROOT, address, base_url, start_redis, start_router, start_worker

MODEL = "tiny"


async def _chat(url: str, headers: dict | None = None, max_tokens: int = 4, stream: bool = False) -> aiohttp.ClientResponse:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json=body, headers=headers or {}) as r:
        await r.read()
        return r


async def _wait_healthy(url: str, n: int, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while True:
            async with s.get(url + "/health") as r:
                body = await r.json()
            if sum(e["healthy"] for e in body["endpoints"]) >= n:
                return body
            if time.monotonic() > deadline:
                raise AssertionError(body)
            await asyncio.sleep(0.2)


async def test_workers_self_register_in_redis_and_leave_on_shutdown(tiny_model_dir, tmp_path):
    redis = start_redis(tmp_path)
    url = f"redis://127.0.0.1:{redis.ports['port']}/0"
    router = start_router(tiny_model_dir, tmp_path, "--served-model-name", MODEL, "--redis-url", url)
    workers = [start_worker("both", tiny_model_dir, tmp_path, "--redis-url", url, "--mooncake-host", "127.0.0.1",
                            name=f"reg{i}") for i in range(2)]
    try:
        body = await _wait_healthy(base_url(router), 2)
        assert {e["address"] for e in body["endpoints"]} == {address(w) for w in workers}
        r = await _chat(base_url(router))
        assert r.status == 200
        workers[0].stop()
        deadline = time.monotonic() + 15
        while True:  # the worker removed itself from the registry; discovery drops it
            async with aiohttp.ClientSession() as s, s.get(base_url(router) + "/health") as resp:
                addrs = {e["address"] for e in (await resp.json())["endpoints"]}
            if addrs == {address(workers[1])}:
                break
            assert time.monotonic() < deadline, addrs
            await asyncio.sleep(0.2)
    finally:
        for p in (router, *workers, redis):
            p.stop()


async def test_admission_control_answers_503_with_retry_after_when_the_fleet_is_full(tiny_model_dir, tmp_path):
    worker = start_worker("both", tiny_model_dir, tmp_path)
    router = start_router(tiny_model_dir, tmp_path, "--served-model-name", MODEL, "--colocated", address(worker),
                          "--max-concurrency", "1", "--max-queue", "0")
    try:
        results = await asyncio.gather(*(_chat(base_url(router), max_tokens=300) for _ in range(6)))
        statuses = sorted(r.status for r in results)
        # Nothing more important holds the slot: the fleet is full, which is a 503 (not the caller's 429).
        assert statuses.count(200) >= 1 and statuses.count(503) >= 1 and 429 not in statuses, statuses
        rejected = next(r for r in results if r.status == 503)
        assert rejected.headers["Retry-After"] == "1"
    finally:
        router.stop()
        worker.stop()


async def test_api_keys_authenticate_and_scope_tenants(tiny_model_dir, tmp_path):
    from grpc_client import stats

    keys = tmp_path / "keys"
    keys.write_text("# key tenant\nsk-alice alice\nsk-bob bob\n")
    worker = start_worker("both", tiny_model_dir, tmp_path)
    router = start_router(tiny_model_dir, tmp_path, "--served-model-name", MODEL, "--colocated", address(worker),
                          "--api-keys", str(keys))
    try:
        assert (await _chat(base_url(router))).status == 401
        assert (await _chat(base_url(router), {"Authorization": "Bearer sk-nope"})).status == 401
        async with aiohttp.ClientSession() as s:
            body = {"model": MODEL, "max_tokens": 2, "temperature": 0,
                    "messages": [{"role": "system", "content": "shared system prompt " * 20},
                                 {"role": "user", "content": "hi"}]}
            hits = []
            for key in ("sk-alice", "sk-alice", "sk-bob"):
                before = (await stats(address(worker))).prefix_hit_tokens
                async with s.post(base_url(router) + "/v1/chat/completions", json=body,
                                  headers={"Authorization": f"Bearer {key}"}) as r:
                    assert r.status == 200
                hits.append((await stats(address(worker))).prefix_hit_tokens - before)
        # Alice's second request reuses her cached prefix; Bob's identical prompt shares nothing.
        assert hits[0] == 0 and hits[1] > 0 and hits[2] == 0, hits
        # A router in front of this one (an OpenAI-compatible upstream that wants a key) sends its
        # key; without one, the client gets a 502 that names the problem, not the upstream's 401.
        with_key = start_router(tiny_model_dir, tmp_path, "--served-model-name", MODEL, "--openai-upstream",
                                base_url(router), "--openai-upstream-api-key", "sk-bob", name="front-key")
        without = start_router(tiny_model_dir, tmp_path, "--served-model-name", MODEL, "--openai-upstream",
                               base_url(router), name="front-nokey")
        try:
            assert (await _chat(base_url(with_key))).status == 200
            r = await _chat(base_url(without))
            assert r.status == 502
            assert "401" in (await r.json())["error"]["message"]
        finally:
            with_key.stop()
            without.stop()
    finally:
        router.stop()
        worker.stop()


async def test_unhealthy_endpoint_is_ejected_and_readmitted(tiny_model_dir, tmp_path):
    w = start_worker("both", tiny_model_dir, tmp_path, name="flaky")
    port = w.ports["grpc"]
    router = start_router(tiny_model_dir, tmp_path, "--served-model-name", MODEL, "--colocated", address(w))
    try:
        await _wait_healthy(base_url(router), 1)
        w.kill()
        r = await _chat(base_url(router))
        assert r.status in (502, 503)
        deadline = time.monotonic() + 10
        while (r := await _chat(base_url(router))).status != 503:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.2)
        w2 = start_worker("both", tiny_model_dir, tmp_path, "--grpc-port", str(port), name="flaky-again")
        try:
            ready = time.monotonic()  # start_worker returned: the worker printed "ready"
            await _wait_healthy(base_url(router), 1, timeout=10)
            # Back in rotation within 3 s of being ready (gRPC's reconnect backoff once made it 15-32 s);
            # the first request then goes there (its own time is the cold worker's, not the router's).
            assert time.monotonic() - ready <= 3.0, time.monotonic() - ready
            assert (await _chat(base_url(router))).status == 200
        finally:
            w2.stop()
    finally:
        router.stop()
        w.kill()


async def test_redis_outage_degrades_affinity_not_requests(tiny_model_dir, tmp_path):
    """Redis down: requests still succeed, and sessions pinned through this router stay on their
    worker (its own copy of the pins answers)."""
    redis = start_redis(tmp_path)
    workers = [start_worker("both", tiny_model_dir, tmp_path, name=f"aff{i}") for i in range(2)]
    router = start_router(tiny_model_dir, tmp_path, "--served-model-name", MODEL, "--colocated",
                          *(address(w) for w in workers), "--policy", "round_robin",
                          "--redis-url", f"redis://127.0.0.1:{redis.ports['port']}/0")
    try:
        sessions = [f"s{i}" for i in range(6)]
        before = {}
        for s in sessions:
            r = await _chat(base_url(router), {"x-session-affinity": s})
            assert r.status == 200
            before[s] = r.headers["X-Splitfire-Decode"]
        assert len(set(before.values())) == 2  # the sessions are spread over both workers
        redis.kill()
        for s in reversed(sessions):  # (unpinned, round-robin would now send each to the other worker)
            r = await _chat(base_url(router), {"x-session-affinity": s}, stream=True)
            assert r.status == 200
            assert r.headers["X-Splitfire-Decode"] == before[s], s
        assert "event=affinity_store_error" in router.log() and "fallback=local" in router.log()
    finally:
        router.stop()
        for w in workers:
            w.stop()
        redis.kill()


def test_router_process_does_not_import_torch():
    """The router never loads a model: building the CLI and the router app must not pull in torch
    (~1.5 s of start-up and ~200 MB per router replica)."""
    import subprocess
    import sys

    code = ("import sys, splitfire_cli, router.app.server; splitfire_cli.build_parser(); "
            "print(sorted(m for m in ('torch', 'numpy', 'safetensors') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


async def test_early_headers_answer_before_a_long_prefill(tiny_model_dir, tmp_path):
    """--early-headers: the 200 arrives at once, the first token after the prefill; a request that
    fails anyway ends with an error event in the stream (the status is already sent)."""
    from procs import free_port

    w = start_worker("both", tiny_model_dir, tmp_path, "--max-num-batched-tokens", "8", "--max-num-seqs", "8",
                     name="slowprefill")
    router = start_router(tiny_model_dir, tmp_path, "--served-model-name", MODEL, "--colocated", address(w),
                          "--early-headers", name="early")
    dead = start_router(tiny_model_dir, tmp_path, "--served-model-name", MODEL, "--colocated",
                        f"127.0.0.1:{free_port()}", "--early-headers", "--max-retries", "0", name="early-dead")
    body = {"model": MODEL, "messages": [{"role": "user", "content": " ".join(["token"] * 140)}], "max_tokens": 2,
            "temperature": 0, "stream": True}
    try:
        async with aiohttp.ClientSession() as s:
            t0 = time.monotonic()
            async with s.post(base_url(router) + "/v1/chat/completions", json=body) as r:
                head_s = time.monotonic() - t0
                assert r.status == 200, await r.text()
                first_token_s = None
                async for line in r.content:
                    if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                        first_token_s = time.monotonic() - t0
                        break
            print(f"early headers: head {head_s * 1000:.1f} ms, first token {first_token_s * 1000:.1f} ms")
            assert first_token_s is not None and head_s < first_token_s / 2, (head_s, first_token_s)
            async with s.post(base_url(dead) + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                text = await r.text()
            assert '"error"' in text and text.rstrip().endswith("data: [DONE]")
    finally:
        for p in (router, dead, w):
            p.stop()


def test_router_waits_for_a_redis_that_starts_after_it(tiny_model_dir, tmp_path):
    """In a cluster the Redis pod may come up after the router: the router retries for --redis-wait
    seconds (logging each miss) instead of exiting; with no Redis at all it exits naming it."""
    from procs import free_port, spawn

    redis_port = free_port()
    url = f"redis://127.0.0.1:{redis_port}/0"
    router = spawn("router-redis-wait", ["router", "--model", str(tiny_model_dir), "--host", "127.0.0.1", "--port",
                                         str(free_port()), "--redis-url", url, "--redis-wait", "60"], tmp_path)
    try:
        deadline = time.monotonic() + 30
        while "event=redis_unreachable" not in router.log():
            assert router.popen.poll() is None and time.monotonic() < deadline, router.log()[-2000:]
            time.sleep(0.2)
        redis = start_redis(tmp_path, redis_port)
        router.wait_for("router ready")
        redis.stop()
    finally:
        router.stop()

    gone = spawn("router-no-redis", ["router", "--model", str(tiny_model_dir), "--host", "127.0.0.1", "--port",
                                     str(free_port()), "--redis-url", f"redis://127.0.0.1:{free_port()}/0",
                                     "--redis-wait", "0.5"], tmp_path)
    assert gone.popen.wait(60) != 0
    assert "cannot reach Redis" in gone.log() and "--redis-wait" in gone.log(), gone.log()[-2000:]
