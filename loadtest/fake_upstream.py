"""An OpenAI-compatible server that streams a fixed number of tokens with no delay: the
zero-cost upstream that isolates the router's own overhead in `bench_router.py`. Events are
compact JSON, as vLLM, SGLang and llama.cpp send them. With `--token-interval-ms` it paces
tokens like a real decode step, so each token reaches the router in a read of its own."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from aiohttp import web

from loadtest.stack import serve_app


def make_app(tokens: int, interval_s: float = 0.0) -> web.Application:
    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = min(int(body.get("max_tokens") or tokens), tokens)
        created = int(time.time())
        if not body.get("stream"):
            return web.json_response({"id": "chatcmpl-fake", "object": "chat.completion", "created": created,
                                      "model": body.get("model"), "choices": [{"index": 0, "message": {
                                          "role": "assistant", "content": "tok " * n}, "finish_reason": "length"}],
                                      "usage": {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        head = f'data: {{"id":"chatcmpl-fake","object":"chat.completion.chunk","created":{created},"model":"fake","choices":[{{"index":0,"delta":{{"content":"tok "}},"finish_reason":null}}]}}\n\n'.encode()
        for _ in range(n):
            await resp.write(head)
            if interval_s:
                await asyncio.sleep(interval_s)
        done = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": created, "model": "fake",
                "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}}
        await resp.write(f"data: {json.dumps(done, separators=(',', ':'))}\n\n".encode() + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--token-interval-ms", type=float, default=0.0, help="pause after each token (0: none)")
    a = p.parse_args()
    serve_app(make_app(a.tokens, a.token_interval_ms / 1000), a.port, f"fake upstream ready on {a.port}")


if __name__ == "__main__":
    main()
