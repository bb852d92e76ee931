"""The direct relay, both ends: in the router (router/direct_relay.py) a mux stream's plain tokens are
written to the client from the worker connection's read callback; in the decode worker
(decode_worker/service.py) they are framed as the engine hands them out. Held equal to the reference
paths (`--stream-relay queued` on both: every token through the streams' handlers) — same text, finish, usage and logprobs for chat and completions read
by the official client, frames never reordered, a client that does not keep up still gets every token in
order, and a failover mid-stream still resumes exactly (tests/test_router_routing.py runs that one on the
default, direct, path)."""

from __future__ import annotations

import asyncio
import json
import re
import socket

import pytest
from openai import AsyncOpenAI
from procs import address, base_url, start_router, start_worker

from router.backends.mux_client import MuxStream

MODEL = "tiny"


async def test_frames_go_to_the_sink_only_while_the_reader_waits_with_nothing_queued():
    taken: list[bytes] = []
    accept = True

    def sink(kind: int, payload: bytes) -> bool:
        if accept:
            taken.append(payload)
        return accept

    s = MuxStream()
    s.sink = sink
    s.offer(1, b"a")  # nobody waits yet (the reader is busy writing): queued
    assert s.frames == [(1, b"a")] and taken == []
    assert await s.take() == [(1, b"a")]
    reader = asyncio.create_task(s.take())
    await asyncio.sleep(0)  # the reader waits now, with nothing queued
    s.offer(1, b"b")
    assert taken == [b"b"] and s.frames == []
    accept = False
    s.offer(1, b"c")  # declined: queued, and the reader woken
    accept = True
    s.offer(1, b"d")  # the reader has not run yet: after "c", never before it
    assert taken == [b"b"]
    assert await reader == [(1, b"c"), (1, b"d")]
    s.offer(1, b"e")  # nobody waiting again
    assert s.frames == [(1, b"e")] and taken == [b"b"]


async def test_outputs_go_to_the_sink_only_while_the_reader_waits_with_nothing_pending():
    from engine.async_engine import RequestStream
    from engine.llm_engine import RequestOutput

    taken: list[list[int]] = []
    accept = True

    def sink(out: RequestOutput) -> bool:
        if accept:
            taken.append(out.token_ids)
        return accept

    s = RequestStream("r")
    s.sink = sink
    s.push(RequestOutput("r", token_ids=[1]))  # the reader is busy: pending
    assert taken == [] and (await s.next()).token_ids == [1]
    reader = asyncio.create_task(s.next())
    await asyncio.sleep(0)
    s.push(RequestOutput("r", token_ids=[2]))
    assert taken == [[2]]
    accept = False
    s.push(RequestOutput("r", token_ids=[3]))  # declined: pending, the reader woken
    accept = True
    s.push(RequestOutput("r", token_ids=[4]))  # merged after 3, never sent before it
    assert taken == [[2]] and (await reader).token_ids == [3, 4]
    s.push(RequestOutput("r", token_ids=[5], finished=True, finish_reason="length"))
    assert (await s.next()).finished and await s.next() is None


@pytest.fixture(scope="module")
def routers(tiny_model_dir, tmp_path_factory):
    """Each path whole: a router and a worker both on the direct relay, and both on the reference."""
    logs = tmp_path_factory.mktemp("logs")
    out = {}
    for mode in ("direct", "queued"):
        worker = start_worker("both", tiny_model_dir, logs, "--max-num-seqs", "32", "--stream-relay", mode,
                              name=f"worker-{mode}")
        out[mode] = (start_router(tiny_model_dir, logs, "--served-model-name", MODEL, "--colocated", address(worker),
                                  "--stream-relay", mode, name=f"router-{mode}"), worker)
    yield out
    for router, worker in out.values():
        router.stop()
        worker.stop()


def relayed(router) -> list[int]:
    return [int(n) for n in re.findall(r"relayed_direct=(\d+)", router.log())]


def sent_direct(worker) -> list[int]:
    return [int(n) for n in re.findall(r"sent_direct=(\d+)", worker.log())]


async def read_chat(client: AsyncOpenAI, i: int, **extra) -> dict:
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"Tell me about the number {i}"}], max_tokens=20 + 3 * i,
        temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, **extra)
    text, finish, usage, lps = "", None, None, []
    async for ev in stream:
        if ev.usage is not None:  # (cached tokens left out: the second router's requests find the first's)
            usage = {k: getattr(ev.usage, k) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        for ch in ev.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
            if ch.logprobs and ch.logprobs.content:
                lps += [(t.token, round(t.logprob, 4)) for t in ch.logprobs.content]
    return {"text": text, "finish": finish, "usage": usage, "logprobs": lps}


async def read_completion(client: AsyncOpenAI, i: int) -> dict:
    stream = await client.completions.create(model=MODEL, prompt=f"Once upon a time {i}", max_tokens=30, temperature=0,
                                             stream=True, stop=[" the"] if i % 2 else None)
    text, finish = "", None
    async for ev in stream:
        for ch in ev.choices:
            text += ch.text
            finish = ch.finish_reason or finish
    return {"text": text, "finish": finish}


async def test_the_direct_relay_streams_what_the_reader_streams(routers):
    got = {}
    for mode, (router, worker) in routers.items():
        before, worker_before = len(relayed(router)), len(sent_direct(worker))
        client = AsyncOpenAI(base_url=base_url(router) + "/v1", api_key="none")
        chats = [read_chat(client, i) for i in range(10)]
        completions = [read_completion(client, i) for i in range(6)]
        with_logprobs = [read_chat(client, i, logprobs=True, top_logprobs=2) for i in range(2)]
        got[mode] = await asyncio.gather(*chats, *completions, *with_logprobs)
        await client.close()
        await asyncio.sleep(0.2)  # (the last request's log line)
        got[mode + " relayed"] = relayed(router)[before:]
        got[mode + " sent"] = sent_direct(worker)[worker_before:]
    assert got["direct"] == got["queued"]
    assert all(r["text"] for r in got["direct"])
    assert got["direct"][0]["usage"]["completion_tokens"] == 20
    assert len(got["direct relayed"]) == 18 and len(got["queued relayed"]) == 18
    assert sum(got["direct relayed"]) > 0.5 * sum(r["usage"]["completion_tokens"] for r in got["direct"][:10])
    assert got["queued relayed"] == [0] * 18
    # Every token of a logprobs request carries logprobs: those never take the router's direct path.
    assert sorted(got["direct relayed"])[:2] == [0, 0]
    # The worker's: every request, most of its tokens (not the first, nor the finish).
    total = sum(r["usage"]["completion_tokens"] for r in got["direct"][:10])
    assert len(got["direct sent"]) == 18 and sum(got["direct sent"][:10]) > 0 and sum(got["direct sent"]) > 0.5 * total
    assert got["queued sent"] == [0] * 18


async def test_the_writer_declines_before_the_head_past_the_high_water_mark_and_once_closing():
    """On a real socket whose peer does not read: tokens go direct only once armed, and stop going direct
    when the transport holds more than HIGH_WATER unsent (they wait for the reader, which waits for the
    client to drain it) or is closing."""
    from common.sampling_params import SamplingParams
    from router.api.protocol import GenRequest
    from router.api.sse import StreamWriter
    from router.app.direct_relay import HIGH_WATER, DirectStream
    from router.core.endpoints import EndpointRegistry
    from router.core.metrics import RouterMetrics
    from router.placement.dispatcher import Latency

    loop = asyncio.get_running_loop()
    accepted: asyncio.Future[socket.socket] = loop.create_future()
    server = await asyncio.start_server(lambda r, w: accepted.set_result(w), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port)
    await accepted  # (the peer never reads)
    req = GenRequest(id="cmpl-1", kind="completion", model=MODEL, prompt_token_ids=[1, 2], sampling=SamplingParams(),
                     stream=True, include_usage=False, tenant="default", session=None, want_logprobs=False, body={})
    used = {"completion": 0}
    ds = DirectStream(StreamWriter(req, MODEL, None), Latency(RouterMetrics(EndpointRegistry()), 0.0), used)
    ds.transport, ds.chunked = transport, True
    assert not ds.ready()  # the head is not out yet
    ds.armed = True
    assert ds.ready()
    ds.tokens("hello", [5])
    ds.tokens("", [6])  # (a token whose text is held back: counted, nothing written)
    assert used["completion"] == 2 and ds.relayed == 2
    while transport.get_write_buffer_size() <= HIGH_WATER:  # the kernel's buffers fill, then the transport's
        ds.tokens("x" * 4096, [7])
        await asyncio.sleep(0)
    assert not ds.ready()
    transport.close()
    assert not ds.ready()
    server.close()


async def test_a_client_that_reads_slowly_gets_every_token_in_order(routers):
    """A client whose socket takes 4 KiB at a time and reads only after the whole answer is generated:
    every token arrives, chunk-framed, in order, the same as through the reader."""
    body = {"model": MODEL, "prompt": "Count forever", "max_tokens": 900, "temperature": 0, "ignore_eos": True,
            "stream": True}
    texts = {}
    for mode, (router, _) in routers.items():
        port = router.ports["http"]
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        payload = json.dumps(body).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: %d\r\n\r\n%b" % (len(payload), payload))
        await asyncio.sleep(3.0)  # the worker generates meanwhile: 900 tokens are ~120 KB of SSE
        raw = b""
        sock.settimeout(30)
        while chunk := await asyncio.to_thread(sock.recv, 65536):
            raw += chunk
        sock.close()
        head, _, rest = raw.partition(b"\r\n\r\n")
        assert b" 200 " in head.split(b"\r\n")[0] and b"chunked" in head.lower()
        body_bytes, pos = b"", 0
        while True:  # undo the chunked framing, checking it
            eol = rest.index(b"\r\n", pos)
            size = int(rest[pos:eol], 16)
            if size == 0:
                break
            body_bytes += rest[eol + 2 : eol + 2 + size]
            assert rest[eol + 2 + size : eol + 4 + size] == b"\r\n"
            pos = eol + 4 + size
        events = [json.loads(line[6:]) for line in body_bytes.split(b"\n") if line.startswith(b"data: {")]
        assert body_bytes.endswith(b"data: [DONE]\n\n")
        texts[mode] = "".join(ch["text"] for e in events for ch in e["choices"])
        assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert texts["direct"] == texts["queued"] and len(texts["direct"]) > 900


async def test_in_front_of_an_openai_server_the_direct_relay_streams_what_the_reader_streams(routers, tiny_model_dir,
                                                                                             tmp_path):
    """`--openai-upstream`: a read of plain deltas in the stream's learned frame goes to the client from
    the upstream connection's read callback (`EventParser.plain_text`); the upstream here is the reference
    stack above (a real OpenAI-compatible server streaming compact JSON, as vLLM and SGLang do)."""
    upstream = base_url(routers["queued"][0])
    fronts = {mode: start_router(tiny_model_dir, tmp_path, "--served-model-name", MODEL, "--openai-upstream", upstream,
                                 "--stream-relay", mode,
                                 name=f"front-{mode}") for mode in ("direct", "queued")}
    try:
        got = {}
        for mode, front in fronts.items():
            client = AsyncOpenAI(base_url=base_url(front) + "/v1", api_key="none")
            got[mode] = await asyncio.gather(*(read_chat(client, i) for i in range(6)),
                                             *(read_completion(client, i) for i in range(4)),
                                             read_chat(client, 1, logprobs=True, top_logprobs=2))
            await client.close()
        await asyncio.sleep(0.2)
        assert got["direct"] == got["queued"] and all(r["text"] for r in got["direct"])
        assert got["direct"][-1]["logprobs"]  # (logprobs deltas are parsed by the reader: extras)
        direct, queued = relayed(fronts["direct"]), relayed(fronts["queued"])
        assert len(direct) == len(queued) == 11 and sum(direct) == 0 == sum(queued)  # (no token ids upstream)
        assert "relayed_reads=" in fronts["direct"].log()
        reads = [int(n) for n in re.findall(r"relayed_reads=(\d+)", fronts["direct"].log())]
        assert sum(reads) > 0 and not any(int(n) for n in re.findall(r"relayed_reads=(\d+)", fronts["queued"].log()))
    finally:
        for p in fronts.values():
            p.stop()
