"""Every token stream between a router and a worker on one connection (`protos/frames.py`, MUX_PATH):
the same text as one HTTP stream each and as gRPC, one connection for many streams, a client that hangs
up cancels only its own request, and bad frames are refused per stream."""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import pytest
from grpc_client import wait_blocks_free
from procs import address, base_url, start_router, start_worker

from protos import frames
from protos import splitfire_pb2 as pb
from router.backends.mux_client import MuxClient

MODEL = "tiny"


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    worker = start_worker("both", tiny_model_dir, logs, "--max-num-seqs", "32")
    routers = {mode: start_router(tiny_model_dir, logs, "--served-model-name", MODEL, "--colocated", address(worker),
                                  "--worker-stream", mode, name=f"router-{mode}") for mode in ("mux", "http", "grpc")}
    yield {"worker": worker, **routers}
    for p in (*routers.values(), worker):
        p.stop()


async def chat(router, content: str, max_tokens: int = 24) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    text = ""
    async with aiohttp.ClientSession() as s, s.post(base_url(router) + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        async for line in r.content:
            if line.startswith(b"data: {"):
                obj = json.loads(line[6:])
                assert "error" not in obj, obj
                text += "".join(ch["delta"].get("content") or "" for ch in obj["choices"])
    return text


def test_frames_are_cut_the_same_whatever_the_reads():
    rng = random.Random(5)
    sent = [(rng.choice([frames.OPEN, frames.EVENT, frames.CANCEL]), rng.randrange(1, 2**32),
             bytes(rng.randrange(256) for _ in range(rng.choice([0, 1, 7, 300]))))
            for _ in range(200)]
    wire = b"".join(frames.encode_mux(*f) for f in sent)
    reader, got, pos = frames.MuxReader(), [], 0
    while pos < len(wire):
        step = rng.choice([1, 3, 9, 64, 1000])
        got += reader.feed(wire[pos : pos + step])
        pos += step
    assert got == sent
    with pytest.raises(ValueError, match="exceeds"):
        frames.MuxReader().feed(frames._MUX_HEADER.pack(frames.EVENT, 1, frames.MAX_FRAME + 1))


async def test_many_streams_on_one_connection_read_the_same_as_http_and_grpc(stack):
    prompts = [f"Tell me about the number {i}" for i in range(12)]
    got = {}
    for mode in ("mux", "http", "grpc"):
        got[mode] = await asyncio.gather(*(chat(stack[mode], p) for p in prompts))
    assert got["mux"] == got["http"] == got["grpc"]
    assert all(got["mux"])
    log = stack["worker"].log()
    assert log.count("event=mux_open") == 1  # one router, one connection for all its streams
    assert f"http_port={stack['worker'].ports['metrics']} mux=True" in stack["mux"].log()


async def test_a_client_that_hangs_up_cancels_only_its_own_stream(stack):
    worker, router = stack["worker"], stack["mux"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count forever"}], "max_tokens": 400,
            "temperature": 0, "ignore_eos": True, "stream": True}
    other = asyncio.create_task(chat(router, "Count to ten", max_tokens=200))
    async with aiohttp.ClientSession() as s, s.post(base_url(router) + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        n = 0
        async for line in r.content:
            n += line.startswith(b"data: {")
            if n >= 5:
                break  # hang up mid-stream
    assert len(await other) > 0
    await wait_blocks_free(address(worker))
    assert "via=mux" in worker.log()
    assert worker.log().count("event=mux_open") == 1


async def test_bad_frames_are_refused_per_stream(stack):
    worker = stack["worker"]
    client = MuxClient()
    try:
        conn = await client.connection("127.0.0.1", worker.ports["metrics"])
        bad_sid, bad = conn.open(b"\xff\xff\xff not a request")
        req = pb.GenerateRequest(token_ids=[5, 6, 7], sampling=pb.SamplingParams(max_tokens=3, temperature=0,
                                                                                  ignore_eos=True))
        good_sid, good = conn.open(req.SerializeToString())
        kind, payload = (await asyncio.wait_for(bad.take(), 10))[0]
        assert kind == frames.ERROR and json.loads(payload)["code"] == "INVALID_ARGUMENT"
        events = []
        while not (events and events[-1].finish_reason):
            events += [pb.GenerateEvent.FromString(p) for k, p in await asyncio.wait_for(good.take(), 10)
                       if k == frames.EVENT]
        assert sum(len(ev.token_ids) for ev in events) == 3
        conn.finish(bad_sid, cancel=False)
        conn.finish(good_sid, cancel=False)
    finally:
        await client.close()
    await wait_blocks_free(address(worker))
