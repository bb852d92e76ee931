"""The least an aiohttp proxy can do for a streamed chat completion: read the body, POST it to
one upstream with the router's own HTTP client, re-frame each read's deltas as OpenAI chunks,
write once per upstream read. No validation, placement, retries, metrics or usage — the CPU
floor of any Python/aiohttp router on this machine, which `bench_router.py` measures beside the
real router so its own per-request cost shows.

`--server asyncio`: the same work behind a bare asyncio.Protocol HTTP/1.1 server instead of aiohttp's
(request head and a Content-Length body parsed by hand, keep-alive, the reply chunked straight onto
the transport) — what the server layer under the router costs, measured: the floor of a Python router
that left aiohttp's server for a lower-level one. A benchmark instrument, not a server: no pipelining,
no chunked request bodies, no limits."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import cast

from aiohttp import web

from loadtest.stack import serve_app
from router.backends.http_client import HTTPClient, chunk
from router.backends.openai_upstream import EventParser

_PRE = b'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"fake","choices":[{"index":0,"delta":{"content":'
_POST = b'},"logprobs":null,"finish_reason":null}]}\n\n'


def make_app(upstream: str) -> web.Application:
    client = HTTPClient()

    async def chat(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        payload = json.dumps({**body, "stream": True}).encode()
        r = await client.request("POST", upstream, "/v1/chat/completions", payload,
                                 {"Content-Type": "application/json"}, 600)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        resp._send_headers_immediately = False  # head and first chunk in one write, as the router does
        await resp.prepare(request)
        events = EventParser()
        try:
            while data := await r.read_some():
                c, done = events.feed(data)
                if c is not None and c.text:
                    await resp.write(_PRE + json.dumps(c.text).encode() + _POST)
                if done:
                    client.release_after_end(r)
                    r = None
                    break
        finally:
            if r is not None:
                client.release(r)
        await resp.write_eof(b"data: [DONE]\n\n")
        return resp

    async def close(_: web.Application) -> None:
        await client.close()

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.on_cleanup.append(close)
    return app


_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


class _Connection(asyncio.Protocol):
    """One client connection of the bare server: a request at a time."""

    def __init__(self, client: HTTPClient, upstream: str):
        self.client, self.upstream = client, upstream
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's transports do not subclass asyncio's)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        length = 0
        for line in self.buf[:end].split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if len(self.buf) < end + 4 + length:
            return
        body, self.buf = self.buf[end + 4 : end + 4 + length], self.buf[end + 4 + length :]
        asyncio.get_running_loop().create_task(self.reply(body))

    async def reply(self, raw: bytes) -> None:
        assert self.transport is not None
        payload = json.dumps({**json.loads(raw), "stream": True}).encode()
        r = await self.client.request("POST", self.upstream, "/v1/chat/completions", payload,
                                      {"Content-Type": "application/json"}, 600)
        events, head = EventParser(), _HEAD
        try:
            while data := await r.read_some():
                c, done = events.feed(data)
                if c is not None and c.text:
                    self.transport.write(head + chunk(_PRE + json.dumps(c.text).encode() + _POST))
                    head = b""
                if done:
                    self.client.release_after_end(r)
                    r = None
                    break
        finally:
            if r is not None:
                self.client.release(r)
        self.transport.write(head + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")


def serve_bare(upstream: str, port: int, banner: str) -> None:
    async def run() -> None:
        client = HTTPClient()
        server = await asyncio.get_running_loop().create_server(lambda: _Connection(client, upstream), "127.0.0.1",
                                                                port)
        print(banner, flush=True)
        await server.serve_forever()

    try:
        import uvloop

        uvloop.run(run())
    except ImportError:
        asyncio.run(run())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True)
    p.add_argument("--server", choices=("aiohttp", "asyncio"), default="aiohttp")
    a = p.parse_args()
    if a.server == "asyncio":
        serve_bare(a.upstream, a.port, f"min proxy ready on {a.port}")
    else:
        serve_app(make_app(a.upstream), a.port, f"min proxy ready on {a.port}")


if __name__ == "__main__":
    main()
