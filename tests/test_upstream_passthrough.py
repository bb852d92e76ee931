"""In front of vLLM/SGLang (`--openai-upstream`): tool calls, reasoning and logprobs reach the
client intact, whether the upstream's deltas arrive one per read or in one burst."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from procs import base_url, free_port, start_router

openai = pytest.importorskip("openai")

MODEL = "up"


def _lp(token: str) -> dict:
    return {"content": [{"token": token, "logprob": -0.5, "bytes": list(token.encode()),
                         "top_logprobs": [{"token": token, "logprob": -0.5, "bytes": list(token.encode())}]}]}


def recorded_events() -> list[dict]:
    """A vLLM 0.11 stream (reasoning parser qwen3, tool parser hermes), as its deltas come."""
    deltas = [({"role": "assistant", "content": ""}, None),
              ({"reasoning_content": "The user"}, None), ({"reasoning_content": " wants weather."}, None),
              ({"content": "Checking"}, _lp("Checking")), ({"content": " now."}, _lp(" now.")),
              ({"tool_calls": [{"index": 0, "id": "chatcmpl-tool-1", "type": "function",
                                "function": {"name": "get_weather", "arguments": ""}}]}, None),
              ({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}, None),
              ({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}, None),
              ({"tool_calls": [{"index": 1, "id": "chatcmpl-tool-2", "type": "function",
                                "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]}, None)]
    events = [{"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1, "model": "m",
               "choices": [{"index": 0, "delta": d, "logprobs": lp, "finish_reason": None}]} for d, lp in deltas]
    events.append({"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1, "model": "m",
                   "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}]})
    events.append({"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
                   "usage": {"prompt_tokens": 20, "completion_tokens": 30, "total_tokens": 50}})
    return events


EXPECTED_CALLS = [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET"}')]


@pytest.fixture(params=["one_per_read", "burst"])
async def upstream(request):
    burst = request.param == "burst"

    async def chat(req: web.Request) -> web.StreamResponse:
        body = await req.json()
        assert body["tools"] and body["stream"]  # the client's fields reach the upstream
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        lines = [f"data: {json.dumps(e, separators=(',', ':'))}\n\n".encode() for e in recorded_events()]
        lines.append(b"data: [DONE]\n\n")
        if burst:
            await resp.write(b"".join(lines))
        else:
            for line in lines:
                await resp.write(line)
                await asyncio.sleep(0.002)  # a read each
        await resp.write_eof()
        return resp

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


async def test_tool_calls_reasoning_and_logprobs_pass_through(upstream, tiny_model_dir, tmp_path):
    router = start_router(tiny_model_dir, tmp_path, "--served-model-name", MODEL, "--openai-upstream", upstream)
    try:
        c = openai.AsyncOpenAI(base_url=base_url(router) + "/v1", api_key="x", max_retries=0)
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "weather and time?"}], tools=TOOLS,
                  logprobs=True, top_logprobs=1)
        r = await c.chat.completions.create(**kw)
        m = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls"
        assert [(t.function.name, t.function.arguments) for t in m.tool_calls] == EXPECTED_CALLS
        assert [t.id for t in m.tool_calls] == ["chatcmpl-tool-1", "chatcmpl-tool-2"]
        assert m.content == "Checking now."
        assert m.model_extra["reasoning_content"] == "The user wants weather."
        assert [lp.token for lp in r.choices[0].logprobs.content] == ["Checking", " now."]

        content, reasoning, calls, tokens, finish = "", "", {}, [], None
        async for ch in await c.chat.completions.create(stream=True, **kw):
            if not ch.choices:
                continue
            d = ch.choices[0].delta
            content += d.content or ""
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            for tc in d.tool_calls or []:
                x = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                x["name"] += (tc.function.name or "") if tc.function else ""
                x["arguments"] += (tc.function.arguments or "") if tc.function else ""
            if ch.choices[0].logprobs and ch.choices[0].logprobs.content:
                tokens += [lp.token for lp in ch.choices[0].logprobs.content]
            finish = ch.choices[0].finish_reason or finish
        assert (content, reasoning, finish) == ("Checking now.", "The user wants weather.", "tool_calls")
        assert [(x["name"], x["arguments"]) for x in calls.values()] == EXPECTED_CALLS
        assert tokens == ["Checking", " now."]
    finally:
        router.stop()
