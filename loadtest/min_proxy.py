"""The least an aiohttp proxy can do for a streamed chat completion: read the body, POST it to
one upstream with the router's own HTTP client, re-frame each read's deltas as OpenAI chunks,
write once per upstream read. No validation, placement, retries, metrics or usage — the CPU
floor of any Python/aiohttp router on this machine, which `bench_router.py` measures beside the
real router so its own per-request cost shows."""

from __future__ import annotations

import argparse
import json

from aiohttp import web

from loadtest.stack import serve_app
from router.http_client import HTTPClient
from router.openai_upstream import EventParser

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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True)
    a = p.parse_args()
    serve_app(make_app(a.upstream), a.port, f"min proxy ready on {a.port}")


if __name__ == "__main__":
    main()
