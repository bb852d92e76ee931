"""The router's OpenAI API against real workers: the official client, streaming format,
and a table of bad inputs that must each get the right 4xx with an OpenAI error body."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from grpc_client import generate, greedy, wait_blocks_free
from procs import address, base_url, start_router, start_worker

MODEL = "tiny"


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("router-logs")
    prefill = start_worker("prefill", tiny_model_dir, logs)
    decode = start_worker("decode", tiny_model_dir, logs, "--local-prefill-max-tokens", "0")
    router = start_router(tiny_model_dir, logs, "--served-model-name", MODEL, "--prefill", address(prefill),
                          "--decode", address(decode), "--max-body-bytes", "200000")
    yield {"prefill": prefill, "decode": decode, "router": router}
    for p in (router, prefill, decode):
        p.stop()


async def test_openai_client_streams_and_matches_direct_worker(stack, tiny_model_dir):
    openai = pytest.importorskip("openai")
    from common.tokenizer import Tokenizer

    client = openai.AsyncOpenAI(base_url=base_url(stack["router"]) + "/v1", api_key="unused")
    tok = Tokenizer(tiny_model_dir)
    messages = [{"role": "user", "content": "The quick brown fox"}]
    direct = await generate(address(stack["decode"]), tok.encode_chat(messages),
                            greedy(12, ignore_eos=False), prefill=address(stack["prefill"]))
    direct_text = direct.text

    r = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == direct_text
    assert r.usage.completion_tokens == len(direct.token_ids)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")

    stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                  stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == direct_text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason in ("length", "stop")
    assert chunks[-1].usage.prompt_tokens == len(tok.encode_chat(messages))
    assert len({c.id for c in chunks}) == 1 and all(c.model == MODEL for c in chunks)

    prompt = "Disaggregated serving"
    direct = await generate(address(stack["decode"]), tok.encode(prompt), greedy(8, ignore_eos=False),
                            prefill=address(stack["prefill"]))
    c = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert c.choices[0].text == direct.text
    s = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True)
    assert "".join([ch.choices[0].text async for ch in s]) == direct.text
    ids = tok.encode(prompt)
    c = await client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert c.choices[0].text == direct.text
    both = await client.completions.create(model=MODEL, prompt=[prompt, "Hello world"], max_tokens=4, temperature=0)
    assert [ch.index for ch in both.choices] == [0, 1] and both.choices[0].text == direct.text[: len(both.choices[0].text)]
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_logprobs_in_chat_and_completions(stack):
    async with aiohttp.ClientSession() as s:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0,
                "logprobs": True, "top_logprobs": 2}
        async with s.post(base_url(stack["router"]) + "/v1/chat/completions", json=body) as r:
            data = await r.json()
        content = data["choices"][0]["logprobs"]["content"]
        assert len(content) == 3 and all(len(c["top_logprobs"]) == 2 and c["logprob"] <= 0 for c in content)
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0, "logprobs": 1}
        async with s.post(base_url(stack["router"]) + "/v1/completions", json=body) as r:
            lp = (await r.json())["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 3


LONG = "word " * 3000
BAD = [
    ("malformed JSON", b'{"model": "tiny", "messages": [', 400),
    ("not an object", b"[1, 2, 3]", 400),
    ("invalid UTF-8", b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400),
    ("empty body", b"", 400),
    ("missing model", {"messages": [{"role": "user", "content": "hi"}]}, 400),
    ("model not a string", {"model": 5, "messages": [{"role": "user", "content": "hi"}]}, 400),
    ("unknown model", {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404),
    ("missing messages", {"model": MODEL}, 400),
    ("empty messages", {"model": MODEL, "messages": []}, 400),
    ("messages not a list", {"model": MODEL, "messages": "hi"}, 400),
    ("message not an object", {"model": MODEL, "messages": ["hi"]}, 400),
    ("bad role", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("content wrong type", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400),
    ("image content part", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400),
    ("negative max_tokens", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}, 400),
    ("zero max_tokens", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400),
    ("huge max_tokens", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}, 400),
    ("max_tokens a string", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "10"}, 400),
    ("max_tokens a float", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1.5}, 400),
    ("temperature too high", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 5}, 400),
    ("temperature a string", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400),
    ("top_p above 1", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}, 400),
    ("n = 0", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 0}, 400),
    ("stop not strings", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": [1, 2]}, 400),
    ("too many stops", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": ["a"] * 40}, 400),
    ("seed a string", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "seed": "x"}, 400),
    ("stream not bool", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400),
    ("stream_options without stream", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}}, 400),
    ("top_logprobs without logprobs", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400),
    ("top_logprobs too many", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 50}, 400),
    ("presence penalty out of range", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "presence_penalty": 3}, 400),
    ("prompt longer than context", {"model": MODEL, "messages": [{"role": "user", "content": LONG}]}, 400),
    ("oversized body", {"model": MODEL, "messages": [{"role": "user", "content": "x" * 300_000}]}, 413),
    ("completions: missing prompt", {"model": MODEL}, 400, "/v1/completions"),
    ("completions: prompt a number", {"model": MODEL, "prompt": 5}, 400, "/v1/completions"),
    ("completions: empty prompt", {"model": MODEL, "prompt": ""}, 400, "/v1/completions"),
    ("completions: token id out of vocab", {"model": MODEL, "prompt": [10**7]}, 400, "/v1/completions"),
    ("completions: negative token id", {"model": MODEL, "prompt": [-1, 5]}, 400, "/v1/completions"),
    ("completions: logprobs too many", {"model": MODEL, "prompt": "hi", "logprobs": 9}, 400, "/v1/completions"),
    ("completions: echo", {"model": MODEL, "prompt": "hi", "echo": True}, 400, "/v1/completions"),
    ("unknown route", {"model": MODEL}, 404, "/v1/embeddings"),
    ("JSON nested 90,000 deep", b'{"model": "tiny", "messages": ' + b"[" * 90_000 + b"]" * 90_000 + b"}", 400),
    ("tools not a list", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": {}}, 400),
    ("tool name with spaces", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                               "tools": [{"type": "function", "function": {"name": "get weather"}}]}, 400),
    ("tool_choice names no tool", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                   "tools": [{"type": "function", "function": {"name": "f"}}],
                                   "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400),
    ("tool_choice without tools", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                   "tool_choice": "required"}, 400),
    ("tool message without its call id", {"model": MODEL, "messages": [{"role": "tool", "content": "42"}]}, 400),
    ("role a list", {"model": MODEL, "messages": [{"role": ["user"], "content": "hi"}]}, 400),
    ("role an object", {"model": MODEL, "messages": [{"role": {"a": 1}, "content": "hi"}]}, 400),
    ("user message without content", {"model": MODEL, "messages": [{"role": "user"}]}, 400),
    ("stop_token_ids a string", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                 "stop_token_ids": ""}, 400),
    ("name not a string", {"model": MODEL, "messages": [{"role": "user", "content": "hi", "name": True}]}, 400),
    ("lone surrogate", b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud83d"}]}', 400),
    ("NaN temperature", b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400),
    ("response_format json_schema invalid", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                             "response_format": {"type": "json_schema",
                                                                 "json_schema": {"name": "x", "schema": {"type": 5}}}}, 400),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
async def test_bad_input_gets_openai_error(stack, case):
    _name, body, status = case[:3]
    path = case[3] if len(case) > 3 else "/v1/chat/completions"
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession() as s:
        async with s.post(base_url(stack["router"]) + path, data=data,
                          headers={"Content-Type": "application/json"}) as r:
            assert r.status == status, await r.text()
            err = (await r.json())["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"]
    assert set(err) == {"message", "type", "param", "code"}


async def test_fuzzed_bodies_never_get_a_server_error(stack):
    """500 malformed bodies (wrong types everywhere, deep nesting, broken JSON and UTF-8, NaN,
    lone surrogates): each gets a 4xx with an OpenAI error object or a normal answer."""
    from loadtest import fuzz

    res = await fuzz.run(base_url(stack["router"]), MODEL, 500, seed=7)
    assert not res.server_errors and res.hangs == 0 and res.bad_error_bodies == 0, res
    assert res.statuses[200] > 20 and res.statuses[400] > 200, res.statuses  # both kinds were exercised


async def test_client_disconnect_frees_worker_blocks(stack):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me everything"}], "max_tokens": 800,
            "temperature": 0, "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(base_url(stack["router"]) + "/v1/chat/completions", json=body) as r:
            seen = 0
            async for line in r.content:
                if line.startswith(b"data:"):
                    seen += 1
                if seen >= 5:
                    break
            rid = r.headers["X-Request-Id"]
            r.close()
    await wait_blocks_free(address(stack["decode"]))
    await wait_blocks_free(address(stack["prefill"]))
    # /metrics agrees with Stats at once (its gauges once kept the last busy step's values).
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{stack['decode'].ports['metrics']}/metrics") as r:
            gauges = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in (await r.text()).splitlines()
                      if line.startswith(("splitfire_worker_kv_blocks_used", "splitfire_worker_running_batch",
                                          "splitfire_worker_queue_depth"))}
    assert gauges == {"splitfire_worker_kv_blocks_used": 0, "splitfire_worker_running_batch": 0,
                      "splitfire_worker_queue_depth": 0}, gauges
    # Freed because the request was cancelled, not because it ran to the end.
    for _ in range(50):
        if f"event=generate_cancelled rid={rid}" in stack["decode"].log():
            break
        await asyncio.sleep(0.1)
    assert f"event=generate_cancelled rid={rid}" in stack["decode"].log()
    assert f"event=generate_done rid={rid}" not in stack["decode"].log()
    # The router's in-flight token estimates let go of the cancelled request too (once the workers'
    # next Stats replaces what they reported while it ran).
    for _ in range(40):
        async with aiohttp.ClientSession() as s, s.get(base_url(stack["router"]) + "/health") as r:
            loads = [e["load"] for e in (await r.json())["endpoints"]]
        if loads == [0, 0]:
            break
        await asyncio.sleep(0.1)
    assert loads == [0, 0], loads


async def test_router_in_front_of_openai_compatible_upstreams(stack, tiny_model_dir, tmp_path):
    """A splitfire router is itself an OpenAI-compatible server: put a second router in front of
    it (plus a dead upstream) and the stream still arrives, the same text, after a retry."""
    from procs import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    front = start_router(tiny_model_dir, tmp_path, "--served-model-name", MODEL, "--openai-upstream",
                         base_url(stack["router"]), dead, "--health-interval", "30", name="front")
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "The quick brown fox"}], "max_tokens": 8,
                "temperature": 0}
        async with aiohttp.ClientSession() as s:
            async with s.post(base_url(stack["router"]) + "/v1/chat/completions", json=body) as r:
                direct = (await r.json())["choices"][0]["message"]["content"]
            for _ in range(3):  # whichever upstream the policy picks first, every request succeeds
                async with s.post(base_url(front) + "/v1/chat/completions", json={**body, "stream": True}) as r:
                    assert r.status == 200
                    text = ""
                    async for line in r.content:
                        if line.startswith(b"data: {"):
                            obj = json.loads(line[6:])
                            assert "error" not in obj
                            if obj["choices"]:
                                text += obj["choices"][0]["delta"].get("content") or ""
                assert text == direct
    finally:
        front.stop()


async def test_token_streams_over_http_and_grpc_are_the_same(stack, tiny_model_dir, tmp_path):
    """By default the router reads decode workers' tokens over their HTTP port (length-prefixed
    frames); `--worker-stream grpc` reads the gRPC stream. The client sees the same thing."""
    dec = stack["decode"]
    assert f"event=endpoint_stream role=decode address={address(dec)} http_port={dec.ports['metrics']}" \
        in stack["router"].log()
    via_grpc = start_router(tiny_model_dir, tmp_path, "--served-model-name", MODEL, "--prefill",
                            address(stack["prefill"]), "--decode", address(dec), "--worker-stream", "grpc",
                            name="grpc-stream")
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Count with me"}], "max_tokens": 24,
                "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                "logprobs": True, "top_logprobs": 2}

        async def run(url: str) -> tuple[str, list, dict]:
            text, lps, usage = "", [], {}
            async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        obj = json.loads(line[6:])
                        usage = obj.get("usage") or usage
                        for ch in obj["choices"]:
                            text += ch["delta"].get("content") or ""
                            lps += [(t["token"], round(t["logprob"], 4)) for t in (ch.get("logprobs") or {}).get("content") or []]
            return text, lps, usage

        http_side, grpc_side = await run(base_url(stack["router"])), await run(base_url(via_grpc))
        assert http_side[:2] == grpc_side[:2] and len(http_side[1]) == 24  # (the second run hits the prefix cache)
        assert http_side[2]["completion_tokens"] == grpc_side[2]["completion_tokens"] == 24
    finally:
        via_grpc.stop()


# A value for each default-only field that asks for something this server does not do.
NOT_DEFAULT = {"store": True, "metadata": {"k": "v"}, "service_tier": "flex", "modalities": ["text", "audio"],
               "reasoning_effort": "high", "verbosity": "low", "audio": {"voice": "alloy", "format": "wav"},
               "prediction": {"type": "content", "content": "x"}, "web_search_options": {},
               "functions": [{"name": "f"}], "function_call": "auto", "moderation": {"model": "m"},
               "prompt_cache_retention": "24h", "prompt_cache_options": {"mode": "x"}}


async def test_every_openai_request_field_is_honoured_or_refused_by_name(stack):
    """The openai SDK's own parameter lists: each field is one we honour or one refused (at a
    value we cannot honour) with a 400 naming it; unknown fields are refused too."""
    from openai.types import completion_create_params as completion_params
    from openai.types.chat import completion_create_params as chat_params

    from router.api.fields import DEFAULT_ONLY, HONOURED

    sdk = {"chat": set(chat_params.CompletionCreateParamsBase.__annotations__),
           "completion": set(completion_params.CompletionCreateParamsBase.__annotations__)}
    for kind, names in sdk.items():
        undecided = names - HONOURED[kind] - set(DEFAULT_ONLY)
        assert not undecided, f"{kind}: no decision for {sorted(undecided)} (router/fields.py)"
    assert set(NOT_DEFAULT) == set(DEFAULT_ONLY)
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with aiohttp.ClientSession() as s:
        for name, value in [*NOT_DEFAULT.items(), ("frobnicate", 1), ("chat_template", "x")]:
            async with s.post(base_url(stack["router"]) + "/v1/chat/completions", json={**base, name: value}) as r:
                assert r.status == 400, (name, await r.text())
                assert (await r.json())["error"]["param"] == name
        for name, value in (("store", False), ("service_tier", "auto"), ("modalities", ["text"]), ("metadata", None),
                            ("user", "u1"), ("safety_identifier", "s1"), ("prompt_cache_key", "k1")):
            async with s.post(base_url(stack["router"]) + "/v1/chat/completions", json={**base, name: value}) as r:
                assert r.status == 200, (name, await r.text())


async def test_logit_bias_and_min_tokens_through_the_openai_client(stack, tiny_model_dir):
    from common.tokenizer import Tokenizer

    openai = pytest.importorskip("openai")
    tok = Tokenizer(tiny_model_dir)
    eos = min(tok.eos_token_ids)
    client = openai.AsyncOpenAI(base_url=base_url(stack["router"]) + "/v1", api_key="x")
    prompt = list(range(5, 30))
    direct = await generate(address(stack["decode"]), prompt, greedy(6), prefill=address(stack["prefill"]))

    async def complete(**kw):
        r = await client.completions.create(model=MODEL, prompt=prompt, temperature=0, **kw)
        return r.choices[0], r.usage

    plain, _ = await complete(max_tokens=6, extra_body={"ignore_eos": True})
    assert plain.text == tok.decode(direct.token_ids)
    banned, _ = await complete(max_tokens=6, logit_bias={str(direct.token_ids[0]): -100}, extra_body={"ignore_eos": True})
    assert banned.text != plain.text
    forced, _ = await complete(max_tokens=4, logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    assert forced.text == tok.decode([42] * 4)
    eager, eager_usage = await complete(max_tokens=8, logit_bias={str(eos): 100})
    held, held_usage = await complete(max_tokens=8, logit_bias={str(eos): 100}, extra_body={"min_tokens": 3})
    assert eager.finish_reason == held.finish_reason == "stop"
    assert eager_usage.completion_tokens <= 1 and 3 <= held_usage.completion_tokens <= 4
    for bad in ({"logit_bias": {"x": 1}}, {"logit_bias": {"5": 101}}, {"extra_body": {"min_tokens": 9}}):
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, **bad)
    await client.close()


async def test_model_details_and_vllm_utility_routes(stack, tiny_model_dir):
    from common.tokenizer import Tokenizer

    openai = pytest.importorskip("openai")
    tok = Tokenizer(tiny_model_dir)
    client = openai.AsyncOpenAI(base_url=base_url(stack["router"]) + "/v1", api_key="x")
    card = await client.models.retrieve(MODEL)
    assert card.id == MODEL and card.owned_by == "splitfire" and card.model_extra["max_model_len"] > 0
    assert (await client.models.list()).data[0].model_extra["root"]
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("no-such-model")
    await client.close()
    url = base_url(stack["router"])
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/tokenize", json={"model": MODEL, "prompt": "Hello world"}) as r:
            got = await r.json()
            assert r.status == 200 and got["tokens"] == tok.encode("Hello world") and got["count"] == len(got["tokens"])
        async with s.post(url + "/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}) as r:
            chat = await r.json()
            assert chat["tokens"] == tok.encode_chat([{"role": "user", "content": "hi"}], add_generation_prompt=True)
        async with s.post(url + "/detokenize", json={"model": MODEL, "tokens": got["tokens"]}) as r:
            assert (await r.json())["prompt"] == tok.decode(got["tokens"])
        async with s.post(url + "/detokenize", json={"model": MODEL, "tokens": [-1]}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "tokens"
        async with s.get(url + "/version") as r:
            assert r.status == 200 and (await r.json())["version"]
        async with s.get(url + "/ping") as r:
            assert r.status == 200


async def test_n_choices_and_best_of(stack):
    openai = pytest.importorskip("openai")
    client = openai.AsyncOpenAI(base_url=base_url(stack["router"]) + "/v1", api_key="x")
    msgs = [{"role": "user", "content": "Name three colours"}]
    one = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0,
                                               extra_body={"ignore_eos": True})
    three = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, n=3,
                                                 extra_body={"ignore_eos": True})
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert {c.message.content for c in three.choices} == {one.choices[0].message.content}  # greedy: identical
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    assert three.usage.completion_tokens == 3 * 6
    seeded = [await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=1.0, n=3,
                                                   seed=11, extra_body={"ignore_eos": True}) for _ in range(2)]
    texts = [[c.message.content for c in r.choices] for r in seeded]
    assert texts[0] == texts[1] and len(set(texts[0])) == 3  # reproducible, and the choices differ
    stream = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0, n=2,
                                                  stream=True, stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})
    got: dict[int, str] = {0: "", 1: ""}
    finished, usage = set(), None
    async for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            got[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1} and got[0] == got[1] and usage.completion_tokens == 10
    assert usage.prompt_tokens == one.usage.prompt_tokens
    # best_of: the candidate with the highest log probability per token, of the ones n=3 would draw.
    prompt = "Once upon a time"
    cands = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=1.0, n=3, seed=5,
                                            logprobs=0, extra_body={"ignore_eos": True})
    best_text = max(cands.choices, key=lambda c: sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs)).text
    best = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=1.0, best_of=3,
                                           seed=5, extra_body={"ignore_eos": True})
    assert len(best.choices) == 1 and best.choices[0].text == best_text and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == 18
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, best_of=3, stream=True)
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, n=3, best_of=2)
    await client.close()


async def test_continuous_usage_stats_put_usage_on_every_chunk(stack):
    # 48 tokens: a worker coalesces what a slow reader has not taken yet, so a short reply on a busy
    # machine can come as a single event.
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count"}], "max_tokens": 48, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    seen = []
    async with aiohttp.ClientSession() as s, s.post(base_url(stack["router"]) + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        async for line in r.content:
            if line.startswith(b"data: {"):
                obj = json.loads(line[6:])
                if obj["choices"] and (obj["choices"][0]["delta"].get("content") or obj["choices"][0]["finish_reason"]):
                    assert "usage" in obj, obj
                    seen.append(obj["usage"]["completion_tokens"])
                    assert obj["usage"]["prompt_tokens"] > 0
    assert seen == sorted(seen) and seen[-1] == 48 and len(seen) >= 3
    async with aiohttp.ClientSession() as s:
        bad = {**body, "stream_options": {"continuous_usage_stats": "yes"}}
        async with s.post(base_url(stack["router"]) + "/v1/chat/completions", json=bad) as r:
            assert r.status == 400


async def test_reset_prefix_cache_route(stack, tiny_model_dir, tmp_path):
    async with aiohttp.ClientSession() as s:
        async with s.post(base_url(stack["router"]) + "/reset_prefix_cache") as r:
            assert r.status == 403  # off unless the operator turns it on
    admin = start_router(tiny_model_dir, tmp_path, "--served-model-name", MODEL, "--prefill",
                         address(stack["prefill"]), "--decode", address(stack["decode"]), "--enable-cache-reset",
                         name="reset-router")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a prompt worth caching " * 8}],
            "max_tokens": 2, "temperature": 0}
    try:
        async with aiohttp.ClientSession() as s:

            async def cached() -> int:
                async with s.post(base_url(admin) + "/v1/chat/completions", json=body) as r:
                    return (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"]

            await cached()
            assert await cached() > 0
            async with s.post(base_url(admin) + "/reset_prefix_cache") as r:
                got = await r.json()
                assert r.status == 200 and got["reset"] and len(got["endpoints"]) == 2, got
            assert await cached() == 0
    finally:
        admin.stop()
