"""Worker lifecycle: SIGTERM drains (in-flight requests finish, new ones are refused), then exits 0;
/health and /metrics answer on the metrics port."""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_client import generate, greedy
from procs import address, start_worker

from protos import splitfire_pb2 as pb
from protos import splitfire_pb2_grpc as pbg


async def test_sigterm_drains_in_flight_requests_then_exits(tiny_model_dir, tmp_path):
    w = start_worker("both", tiny_model_dir, tmp_path, "--drain-timeout", "30", "--max-num-seqs", "4",
                     "--max-num-batched-tokens", "8")
    try:
        health = f"http://127.0.0.1:{w.ports['metrics']}/health"
        assert json.loads(urllib.request.urlopen(health, timeout=5).read())["status"] == "serving"
        channel = grpc.aio.insecure_channel(address(w))
        # ~900 decode steps: seconds of work, so the drain is observed while it is in flight.
        call = pbg.DecodeStub(channel).Generate(pb.GenerateRequest(token_ids=[3 + i % 390 for i in range(100)],
                                                                   sampling=greedy(900)))
        tokens = list((await call.read()).token_ids)  # the first token: the request is in flight
        w.popen.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.1)
        with pytest.raises(urllib.error.HTTPError) as err:  # load balancers stop sending here
            urllib.request.urlopen(health, timeout=5)
        assert err.value.code == 503
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await generate(address(w), [5, 6, 7], greedy(2))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.value.details()
        finish = ""
        while (ev := await call.read()) is not grpc.aio.EOF:  # the in-flight request runs to its end
            tokens += ev.token_ids
            finish = ev.finish_reason or finish
        await channel.close()
        assert len(tokens) == 900 and finish == "length"
        assert await asyncio.to_thread(w.popen.wait, 20) == 0
        assert "event=worker_stopped" in w.log()
    finally:
        w.kill()


async def test_stats_answer_at_once_while_a_long_step_runs(tiny_model_dir):
    """The router's checks read Stats; they must not queue behind the step in progress (a busy
    worker was ejected as unhealthy when they did)."""
    import threading

    from engine_helpers import make_engine

    from common.sampling_params import SamplingParams
    from engine.async_engine import AsyncEngine

    in_step, release = threading.Event(), threading.Event()

    class SlowStep:  # a StepObserver that holds the first forward pass until released
        def before_forward(self, batch) -> None:
            in_step.set()

        def after_layer(self, layer: int) -> None:
            pass

        def after_forward(self) -> dict[str, str]:
            release.wait(10)
            return {}

    aeng = AsyncEngine(make_engine(tiny_model_dir), observer=SlowStep())
    aeng.start()
    try:
        stream = aeng.open_stream("r")
        await aeng.call(lambda e: e.add_request("r", [5, 6, 7, 8, 9], SamplingParams(max_tokens=2, ignore_eos=True)))
        assert await asyncio.to_thread(in_step.wait, 10)
        st = aeng.stats  # read while the engine thread is stuck inside the step
        assert st.waiting + st.running == 1 and st.prompt_tokens_in_flight == 5
        release.set()
        outs = [o async for o in stream]
        assert outs[-1].finished
        await asyncio.sleep(0.05)
        st = aeng.stats
        assert (st.running, st.waiting, st.kv_tokens_held, st.decode_tokens_remaining) == (0, 0, 0, 0)
    finally:
        release.set()
        await aeng.stop()


async def test_start_up_heap_is_frozen_once_ready(tiny_model_dir, tmp_path, monkeypatch):
    """common/gc_heap.py: the worker and the router hold the collector off while they start and freeze
    what start-up built once ready (their logs say how much); SPLITFIRE_GC_FREEZE=0 leaves it alone.
    Either way they serve."""
    import re

    from procs import start_router, stop_all

    w = start_worker("both", tiny_model_dir, tmp_path, name="frozen")
    r = start_router(tiny_model_dir, tmp_path, "--decode", address(w), name="router-frozen")
    monkeypatch.setenv("SPLITFIRE_GC_FREEZE", "0")
    plain = start_worker("both", tiny_model_dir, tmp_path, name="unfrozen")
    try:
        for p in (w, plain):
            assert len((await generate(address(p), [5, 6, 7], greedy(4))).token_ids) == 4
        for p, what in ((w, "both worker"), (r, "router")):
            p.wait_for("event=gc_frozen", timeout=10)
            frozen = re.search(rf"event=gc_frozen process={what} objects=(\d+)", p.log())
            assert frozen and int(frozen.group(1)) > 50_000, p.log()[-2000:]  # ~100k for the router, ~300k with torch
        assert "gc_frozen" not in plain.log()
    finally:
        stop_all(w, r, plain)
