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
