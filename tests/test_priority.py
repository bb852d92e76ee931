"""Request priorities (vLLM's `priority`: lower is more important) and honest overload answers: bands in
the router's admission (the most important first, the least important shed first), in the engine's
scheduler (admitted first, preempted last), per-key defaults and limits; 429 only for the caller's own
quota or a shed band, 503 when the fleet itself is full or has no worker."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from engine_helpers import make_engine
from engine_helpers import step_tokens as _step
from procs import address, base_url, start_router, start_worker
from reference import Reference

from common.sampling_params import SamplingParams
from router.api.errors import APIError
from router.core.endpoints import EndpointRegistry
from router.core.metrics import RouterMetrics
from router.tenancy.admission import Admission
from router.tenancy.tenants import read_keys

MODEL = "tiny"
GREEDY = dict(temperature=0.0, ignore_eos=True)


def _prompt(i: int, n: int = 12) -> list[int]:
    return [(11 * i + 7 * j) % 300 + 3 for j in range(n)]


class _Holders:
    """Tasks that take a slot and hold it until let go, recording the order they got it in."""

    def __init__(self, adm: Admission):
        self.adm = adm
        self.order: list[str] = []
        self.gate = asyncio.Event()
        self.tasks: list[asyncio.Task] = []

    def start(self, name: str, priority: int, tenant: str = "t", weight: float = 1.0) -> asyncio.Task:
        async def one() -> None:
            async with self.adm.slot(tenant, weight, priority):
                self.order.append(name)
                await self.gate.wait()
                self.gate.clear()

        t = asyncio.create_task(one())
        self.tasks.append(t)
        return t

    async def advance(self) -> None:
        n = len(self.order)
        self.gate.set()
        for _ in range(1000):
            if len(self.order) > n:
                return
            await asyncio.sleep(0)
        raise AssertionError("no grant")

    def cancel(self) -> None:
        for t in self.tasks:
            t.cancel()


async def test_the_most_important_band_is_admitted_first_and_fairness_holds_inside_a_band():
    adm = Admission(1, 1000, 60, RouterMetrics(EndpointRegistry(16)))
    h = _Holders(adm)
    try:
        h.start("first", 0)
        await asyncio.sleep(0)
        for i in range(6):
            h.start(f"low{i}", 10)
        await asyncio.sleep(0)
        # More important requests arriving behind a queue of less important ones go ahead of all of them;
        # inside their band, tenants a (weight 2) and b (weight 1) share 2:1.
        for i in range(6):
            h.start(f"a{i}", 0, "a", 2.0)
            h.start(f"b{i}", 0, "b", 1.0)
        await asyncio.sleep(0)
        assert adm.waiting == 18
        for _ in range(9):
            await h.advance()
        high = h.order[1:10]
        assert all(not n.startswith("low") for n in high), h.order
        assert sum(n.startswith("a") for n in high) == 6 and sum(n.startswith("b") for n in high) == 3, high
        while len(h.order) < 19:
            await h.advance()
        # The less important band runs once nothing more important waits, in its own arrival order.
        assert [n for n in h.order if n.startswith("low")] == [f"low{i}" for i in range(6)]
        assert h.order.index("low0") > max(h.order.index(f"b{i}") for i in range(6))
        h.gate.set()
        await asyncio.gather(*h.tasks)
        assert adm.running == 0 and adm.waiting == 0 and not adm.queues and not adm.running_by_band
    finally:
        h.cancel()


async def test_a_full_queue_sheds_the_least_important_band_with_429_and_is_503_when_nothing_outranks():
    metrics = RouterMetrics(EndpointRegistry(16))
    adm = Admission(1, 2, 60, metrics)
    h = _Holders(adm)
    try:
        h.start("running", 5)
        await asyncio.sleep(0)
        low = [h.start(f"low{i}", 10) for i in range(2)]
        await asyncio.sleep(0)
        assert adm.waiting == 2
        # A more important request takes the place of the least important band's newest waiter.
        h.start("high0", 0)
        await asyncio.sleep(0)
        with pytest.raises(APIError) as e:
            await low[1]
        assert e.value.status == 429 and e.value.code == "priority_shed" and e.value.param == "priority"
        assert e.value.headers["Retry-After"] == "1"
        assert not low[0].done() and adm.waiting == 2
        # A request no more important than anything waiting gets no place; more important work holds
        # the fleet, so its band is shed: 429.
        with pytest.raises(APIError) as e:
            async with adm.slot("t", 1.0, 10):
                pass
        assert e.value.status == 429 and e.value.code == "priority_shed"
        h.start("high1", 0)  # sheds low0
        await asyncio.sleep(0)
        with pytest.raises(APIError) as e:
            await low[0]
        assert e.value.code == "priority_shed"
        # The queue holds only the most important band now: a request of that band finds the fleet
        # full with nothing more important than itself in it: 503 (the fleet's problem, not the caller's).
        with pytest.raises(APIError) as e:
            async with adm.slot("t", 1.0, 0):
                pass
        assert e.value.status == 503 and e.value.code == "no_capacity" and e.value.headers["Retry-After"] == "1"
        while len(h.order) < 3:
            await h.advance()
        assert h.order == ["running", "high0", "high1"]
        h.gate.set()
        await asyncio.gather(*(t for t in h.tasks if t not in low))
        refused = {s.labels["reason"]: s.value for m in metrics.registry.collect()
                   if m.name == "splitfire_router_admission_refused" for s in m.samples if s.name.endswith("_total")}
        assert refused == {"priority_shed": 3.0, "no_capacity": 1.0}, refused
        assert adm.running == 0 and adm.waiting == 0 and not adm.queues
    finally:
        h.cancel()


async def test_a_queue_timeout_is_a_shed_429_only_when_more_important_work_holds_the_slots():
    adm = Admission(1, 10, 0.2, RouterMetrics(EndpointRegistry(16)))
    h = _Holders(adm)
    try:
        h.start("important", 0)
        await asyncio.sleep(0)
        for prio, status, code in ((10, 429, "priority_shed"), (0, 503, "no_capacity")):
            with pytest.raises(APIError) as e:
                async with adm.slot("t", 1.0, prio):
                    pass
            assert (e.value.status, e.value.code) == (status, code), prio
        assert adm.waiting == 0
        h.gate.set()
        await asyncio.gather(*h.tasks)
    finally:
        h.cancel()


def test_key_priorities_default_and_limit(tmp_path):
    f = tmp_path / "keys.json"
    f.write_text(json.dumps({"keys": {"sk-batch": {"tenant": "b", "priority": 10, "min_priority": 5},
                                      "sk-any": "a"}}))
    keys = read_keys(str(f))
    batch, anyone = keys["sk-batch"], keys["sk-any"]
    assert batch.priority_of(None) == 10 and batch.priority_of(7) == 7 and batch.priority_of(5) == 5
    with pytest.raises(APIError) as e:
        batch.priority_of(4)
    assert e.value.status == 400 and e.value.param == "priority"
    assert anyone.priority_of(None) == 0 and anyone.priority_of(-3) == -3
    for bad, why in (({"tenant": "x", "priority": "high"}, "32-bit integer"),
                     ({"tenant": "x", "priority": 1, "min_priority": 2}, "more important than 'min_priority'")):
        f.write_text(json.dumps({"keys": {"k": bad}}))
        with pytest.raises(ValueError, match=why):
            read_keys(str(f))


# -- engine: priority scheduling ---------------------------------------------------------------


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    return Reference(tiny_model_dir)


def test_an_important_prompt_preempts_the_least_important_and_outputs_stay_exact(tiny_model_dir, ref):
    engine = make_engine(tiny_model_dir, max_num_seqs=3, max_num_batched_tokens=64)
    outs: dict[str, list[int]] = {}
    for i in range(3):
        engine.add_request(f"low{i}", _prompt(i), SamplingParams(max_tokens=30, **GREEDY), priority=10)
    for _ in range(3):
        _step(engine, outs)
    assert len(engine.scheduler.running) == 3
    # The batch is full: a more important prompt takes the place of the newest low one at once.
    engine.add_request("mid", _prompt(20), SamplingParams(max_tokens=30, **GREEDY), priority=5)
    assert "mid" in _step(engine, outs)
    assert {s.request_id for s in engine.scheduler.running} == {"low0", "low1", "mid"}
    assert engine.scheduler.num_priority_preemptions == 1
    assert _step(engine, outs) == {"low0", "low1", "mid"}  # (never two steps of their own in a row)
    engine.add_request("high", _prompt(30), SamplingParams(max_tokens=5, **GREEDY), priority=0)
    # More important than everything running: a step of its own (the others' streams wait that one step).
    assert _step(engine, outs) == {"high"}
    assert _step(engine, outs) == {"low0", "mid", "high"}
    assert {s.request_id for s in engine.scheduler.running} == {"low0", "mid", "high"}
    while engine.has_work:
        _step(engine, outs)
    for i in range(3):
        assert outs[f"low{i}"] == ref.greedy(_prompt(i), 30), i
    assert outs["mid"] == ref.greedy(_prompt(20), 30)
    assert outs["high"] == ref.greedy(_prompt(30), 5)


def test_kv_pressure_preempts_the_least_important_even_when_it_is_older(tiny_model_dir, ref):
    page_bytes = 2 * 16 * 2 * 16 * 4 * 2
    engine = make_engine(tiny_model_dir, kv_cache_gb=11 * page_bytes / 2**30, max_num_batched_tokens=128)
    assert engine.blocks.num_blocks == 11
    # The low one arrived first: first come, first served would preempt one of the newer, important ones.
    engine.add_request("low", _prompt(0, 20), SamplingParams(max_tokens=25, **GREEDY), priority=3)
    for i in range(3):
        engine.add_request(f"hi{i}", _prompt(i + 1, 20), SamplingParams(max_tokens=25, **GREEDY), priority=1)
    preempted: list[str] = []
    outs: dict[str, list[int]] = {}
    while engine.has_work:
        before = {s.request_id: s.num_preemptions for s in engine.seqs.values()}
        _step(engine, outs)
        preempted += [s.request_id for s in engine.seqs.values() if s.num_preemptions > before.get(s.request_id, 0)]
    assert preempted and set(preempted) == {"low"}, preempted
    assert outs["low"] == ref.greedy(_prompt(0, 20), 25)
    for i in range(3):
        assert outs[f"hi{i}"] == ref.greedy(_prompt(i + 1, 20), 25), i


# -- through the router: the field, the key's limits, 429 vs 503 -------------------------------


async def _post(url: str, body: dict, key: str = "") -> tuple[int, dict, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        return r.status, dict(r.headers), await r.json(content_type=None)


def _chat(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
            "ignore_eos": True, **extra}


async def test_priority_reaches_both_workers_and_keys_limit_it(tiny_model_dir, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": {"sk-batch": {"tenant": "b", "priority": 10, "min_priority": 5},
                                         "sk-any": {"tenant": "a"}}}))
    pre = start_worker("prefill", tiny_model_dir, tmp_path, wait=False)
    dec = start_worker("decode", tiny_model_dir, tmp_path, "--local-prefill-max-tokens", "0", wait=False)
    pre.wait_for("worker ready")
    dec.wait_for("worker ready")
    router = start_router(tiny_model_dir, tmp_path, "--served-model-name", MODEL, "--prefill", address(pre),
                          "--decode", address(dec), "--api-keys", str(keys))
    url = base_url(router)
    try:
        status, _, plain = await _post(url, _chat(), "sk-any")
        assert status == 200
        status, _, body = await _post(url, _chat(priority=-7), "sk-any")
        assert status == 200 and body["choices"][0]["message"] == plain["choices"][0]["message"]
        assert (await _post(url, _chat(), "sk-batch"))[0] == 200  # the key's default: 10
        status, _, body = await _post(url, _chat(priority=1), "sk-batch")
        assert status == 400 and body["error"]["param"] == "priority" and "5" in body["error"]["message"]
        status, _, body = await _post(url, _chat(priority="high"), "sk-any")
        assert status == 400 and body["error"]["param"] == "priority"
        await asyncio.sleep(0.5)
        # The decode worker and the prefill worker each ran the requests at their priority.
        for w in (dec, pre):
            seen = [line.rsplit("priority=", 1)[1].split()[0] for line in w.log().splitlines()
                    if ("event=generate_done" in line or "event=prefill_done" in line) and "priority=" in line]
            assert seen == ["0", "-7", "10"], (w.name, seen)
    finally:
        router.stop()
        pre.stop()
        dec.stop()


async def test_no_worker_and_a_full_router_are_503_with_retry_after(tiny_model_dir, tmp_path):
    router = start_router(tiny_model_dir, tmp_path, "--served-model-name", MODEL, "--decode", "127.0.0.1:1")
    try:
        await asyncio.sleep(1.5)  # two failed health checks
        status, headers, body = await _post(base_url(router), _chat())
        assert status == 503 and int(headers["Retry-After"]) >= 1, body
        assert body["error"]["type"] == "service_unavailable"
    finally:
        router.stop()
    worker = start_worker("both", tiny_model_dir, tmp_path)
    router = start_router(tiny_model_dir, tmp_path, "--served-model-name", MODEL, "--colocated", address(worker),
                          "--max-concurrency", "1", "--max-queue", "0")
    url = base_url(router)
    try:
        async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions",
                                                        json=_chat(max_tokens=200, stream=True)) as held:
            assert held.status == 200
            await held.content.readline()  # the stream holds the one slot
            status, headers, body = await _post(url, _chat())
            assert status == 503 and headers["Retry-After"] == "1" and body["error"]["code"] == "no_capacity", body
            # Something less important than what holds the slot is shed: 429 naming priority.
            status, headers, body = await _post(url, _chat(priority=3))
            assert status == 429 and body["error"]["code"] == "priority_shed" and body["error"]["param"] == "priority"
            assert b"[DONE]" in await held.content.read()
    finally:
        router.stop()
        worker.stop()
