"""Endpoint health as the router decides it: the circuit breaker (error rate, half-open probe,
re-admission), the load a locally prefilled request leaves where, and upstreams that name their
own models."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from aiohttp import web
from procs import base_url, free_port, spawn

from router.backends.backend import Route
from router.backends.worker_client import WorkerClient
from router.core.breaker import CLOSED, HALF_OPEN, OPEN, BreakerConfig, CircuitBreaker
from router.core.endpoints import EndpointRegistry
from router.core.prefix_index import PrefixIndex
from router.placement.attempt import Attempt


def test_one_failure_does_not_eject_but_a_high_error_rate_does():
    b = CircuitBreaker(BreakerConfig(window=20, min_requests=6, error_rate=0.5, consecutive=3, open_s=0.05))
    b.on_failure()
    assert b.state == CLOSED and b.available()
    for i in range(10):  # alternate: 50% failures, never two in a row
        if b.state != CLOSED:
            break
        b.on_success() if i % 2 == 0 else b.on_failure()
    assert b.state == OPEN and not b.available()
    time.sleep(0.06)
    assert b.available() and b.state == HALF_OPEN  # the wait is over: one probe may go
    b.on_attempt()
    assert not b.available()  # only one probe at a time
    b.on_failure()  # the probe failed: open again, for twice as long
    assert b.state == OPEN and b.open_for == pytest.approx(0.1)
    time.sleep(0.11)
    assert b.available()
    b.on_attempt()
    b.on_success()
    assert b.state == CLOSED and b.available() and not b.outcomes


def test_health_checks_open_the_breaker_and_a_passing_check_half_opens_it_at_once():
    b = CircuitBreaker(BreakerConfig(unhealthy_after=2, open_s=60))
    assert b.on_check(False) is None and b.state == CLOSED
    assert b.on_check(False) == "opened" and b.state == OPEN
    assert b.on_check(True) == "half_open" and b.available()  # no 60 s wait for a restarted worker
    # Opened by failing requests, a passing health check proves nothing: it stays open.
    b2 = CircuitBreaker(BreakerConfig(consecutive=3, open_s=60))
    for _ in range(3):
        b2.on_failure()
    assert b2.state == OPEN
    assert b2.on_check(True) is None and not b2.available()


def test_a_retry_goes_to_a_probing_endpoint_rather_than_nowhere():
    """Two decode workers: one half-open with its probe in flight, the other closed. A new request
    goes to the closed one; when that one fails the request (it is draining), the retry, which
    excludes it, goes to the probing one instead of failing with nowhere to go (seen in the chaos
    suite's SIGTERM drain right after another scenario had restarted the other worker)."""
    reg = EndpointRegistry(breaker=BreakerConfig(unhealthy_after=1, open_s=60))
    a, b = reg.add("a:1", "decode"), reg.add("b:1", "decode")
    reg.on_check(a, False)
    reg.on_check(a, True)  # restarted: half-open
    assert reg.on_attempt(a)  # its probe is in flight
    assert reg.healthy("decode") == [b]
    assert reg.healthy("decode", {"b:1"}) == [a]
    reg.on_check(b, False)  # b down (open) too: nothing for a request that excludes a
    assert reg.healthy("decode", {"a:1"}) == []


def test_a_locally_prefilled_request_leaves_no_load_on_the_prefill_endpoint():
    reg = EndpointRegistry()
    p, d = reg.add("p:1", "prefill"), reg.add("d:1", "decode")
    a = Attempt(0, Route(d, p), WorkerClient(), reg, PrefixIndex(10), [], prompt_tokens=400, resumed_tokens=0,
                max_tokens=50)
    assert p.prefill_load() == 400 and p.active == 1
    a.on_prefill_mode("local")  # the decode worker said so before prefilling
    assert p.prefill_load() == 0 and p.active == 0
    assert d.prefill_load() == 400 and d.decode_load() == 450
    a.on_output(1)
    assert d.prefill_load() == 0 and p.prefill_load() == 0 and p.active == 0
    a.close()
    assert (p.load(), d.load(), p.active, d.active) == (0, 0, 0, 0)
    # Remote: the prefill endpoint carries the prompt until the first token.
    b = Attempt(1, Route(d, p), WorkerClient(), reg, PrefixIndex(10), [], prompt_tokens=400, resumed_tokens=0,
                max_tokens=50)
    b.on_prefill_mode("remote")
    assert p.prefill_load() == 400 and d.prefill_load() == 0
    b.on_output(1)
    b.close()
    assert (p.load(), d.load(), p.active, d.active) == (0, 0, 0, 0)


class FakeUpstream:
    """A real HTTP server speaking OpenAI chat streaming, that fails on demand."""

    def __init__(self, models: list[str], text: str):
        self.models, self.text = models, text
        self.fail_every = 0  # fail every n-th request (0: never)
        self.calls = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def chat(self, req: web.Request) -> web.StreamResponse:
        body = await req.json()
        self.calls += 1
        if self.fail_every and self.calls % self.fail_every == 0:
            return web.json_response({"error": {"message": "injected failure"}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        for piece in (self.text, ""):
            ev = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": body["model"],
                  "choices": [{"index": 0, "delta": {"content": piece} if piece else {},
                               "finish_reason": None if piece else "stop"}]}
            await resp.write(f"data: {json.dumps(ev)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def list_models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]})

    async def __aenter__(self) -> FakeUpstream:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.list_models)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


async def start_upstream_router(tmp_path, *extra: str, name: str):
    """A router with no model of its own: only OpenAI-compatible upstreams (served by this test's
    event loop, so the wait for the router must not block it)."""
    port = free_port()
    p = spawn(name, ["router", "--host", "127.0.0.1", "--port", str(port), *extra], tmp_path)
    p.ports = {"http": port}
    deadline = time.monotonic() + 60
    while "router ready" not in p.log():
        assert p.popen.poll() is None and time.monotonic() < deadline, p.log()
        await asyncio.sleep(0.05)
    return p


async def _ask(s: aiohttp.ClientSession, url: str, model: str) -> tuple[int, str]:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with s.post(url + "/v1/chat/completions", json=body) as r:
        got = await r.json()
        if r.status != 200:
            return r.status, got["error"]["message"]
        return 200, got["choices"][0]["message"]["content"]


async def _endpoint_health(s: aiohttp.ClientSession, url: str) -> dict[str, bool]:
    async with s.get(url + "/health") as r:
        return {e["address"]: e["healthy"] for e in (await r.json())["endpoints"]}


async def test_a_flaky_upstream_is_ejected_probed_and_readmitted(tmp_path):
    async with FakeUpstream(["m"], "steady") as good, FakeUpstream(["m"], "flaky") as bad:
        router = await start_upstream_router(tmp_path, "--openai-upstream", good.url, bad.url, "--policy", "round_robin",
                                       "--health-interval", "30", "--breaker-open-s", "1", name="breaker")
        url = base_url(router)
        try:
            async with aiohttp.ClientSession() as s:
                bad.fail_every = 1_000_000  # first: exactly one failure
                bad.calls = 1_000_000 - 1
                for _ in range(4):
                    assert (await _ask(s, url, "m"))[0] == 200  # the failed one is retried on the other
                assert (await _endpoint_health(s, url))[bad.url], "one failure must not eject"
                bad.fail_every, bad.calls = 2, 0  # now half of its requests fail
                for _ in range(40):
                    status, _ = await _ask(s, url, "m")
                    assert status == 200  # clients never see the failures
                    if not (await _endpoint_health(s, url))[bad.url]:
                        break
                assert not (await _endpoint_health(s, url))[bad.url], "a 50% error rate must eject"
                ejected_calls = bad.calls
                for _ in range(6):  # while open, nothing goes there
                    assert await _ask(s, url, "m") == (200, "steady")
                assert bad.calls == ejected_calls
                bad.fail_every = 0  # it recovers; after the open period a probe request readmits it
                await asyncio.sleep(1.1)
                texts = [(await _ask(s, url, "m"))[1] for _ in range(6)]
                assert "flaky" in texts and (await _endpoint_health(s, url))[bad.url]
            assert "event=endpoint_readmitted" in router.log() and "via=probe_request" in router.log()
        finally:
            router.stop()


async def test_model_names_come_from_the_upstreams(tmp_path):
    async with FakeUpstream(["alpha"], "from-a") as a, FakeUpstream(["beta", "gamma"], "from-b") as b:
        router = await start_upstream_router(tmp_path, "--openai-upstream", a.url, "--openai-upstream", b.url,
                                       name="models")
        url = base_url(router)
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(url + "/v1/models") as r:
                    assert sorted(m["id"] for m in (await r.json())["data"]) == ["alpha", "beta", "gamma"]
                for _ in range(3):  # each model goes to the upstream that serves it (both flags used)
                    assert await _ask(s, url, "alpha") == (200, "from-a")
                    assert await _ask(s, url, "gamma") == (200, "from-b")
                status, message = await _ask(s, url, "delta")
                assert status == 404 and "alpha" in message
        finally:
            router.stop()
