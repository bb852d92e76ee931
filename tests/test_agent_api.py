"""Tool calls and structured output through the router with the official `openai` client:
grammars survive disaggregation and failover, replies validate, bad schemas are 400s."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import jsonschema
import pytest
from hf_models import make_hf_model
from procs import address, base_url, start_router, start_worker, stop_all

openai = pytest.importorskip("openai")

MODEL = "tiny-qwen"
# A Qwen2.5-style template: tools in the system turn, calls as <tool_call> blocks, results as
# <tool_response> in a user turn.
QWEN_TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{% for message in messages %}
{% if message.role == 'system' %}
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}{% for tc in message.tool_calls %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME}}]
PARAMS = {"get_weather": WEATHER, "get_time": TIME}
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12},
                                            "score": {"type": "integer", "minimum": 0, "maximum": 9},
                                            "ok": {"type": "boolean"}},
          "required": ["answer", "score", "ok"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    hf = make_hf_model("qwen3", tmp_path_factory.mktemp("agent") / "m")
    cfg = json.loads((hf.path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = QWEN_TOOLS_TEMPLATE
    (hf.path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return hf.path


@pytest.fixture(scope="module")
def stack(qwen_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("agent-logs")
    pre = start_worker("prefill", qwen_dir, logs, wait=False)
    dec = start_worker("decode", qwen_dir, logs, "--local-prefill-max-tokens", "0", wait=False)
    both = start_worker("both", qwen_dir, logs, wait=False)
    for w in (pre, dec, both):
        w.wait_for("worker ready")
    pd = start_router(qwen_dir, logs, "--served-model-name", MODEL, "--prefill", address(pre), "--decode", address(dec))
    co = start_router(qwen_dir, logs, "--served-model-name", MODEL, "--colocated", address(both), name="router-co")
    yield {"pd": pd, "co": co}
    stop_all(pd, co, pre, dec, both)


def client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url(router) + "/v1", api_key="unused", max_retries=0)


def ask(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Question {i}: what is the weather and time in city {i}?"}]


def streamed(stream) -> tuple[str, dict[int, dict], str | None]:
    """What the openai SDK's chunks add up to: content, tool calls by index, finish reason."""
    content, calls, finish = "", {}, None
    for ch in stream:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            c["id"] += tc.id or ""
            if tc.function is not None:
                c["name"] += tc.function.name or ""
                c["arguments"] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=3), dict(temperature=0.8, top_p=0.9, seed=8)])
def test_json_schema_replies_validate_streamed_and_not(stack, sampling):
    c = client(stack["pd"])
    for i in range(3):
        r = c.chat.completions.create(model=MODEL, messages=ask(i), response_format=JSON_SCHEMA, max_tokens=60, **sampling)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), ANSWER)
        content, _, finish = streamed(c.chat.completions.create(
            model=MODEL, messages=ask(i), response_format=JSON_SCHEMA, max_tokens=60, stream=True, **sampling))
        assert finish == "stop" and content == r.choices[0].message.content


def test_json_object_parses(stack):
    r = client(stack["pd"]).chat.completions.create(model=MODEL, messages=ask(5), max_tokens=80, temperature=0,
                                                    response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut off by max_tokens: still a valid JSON prefix starting an object
        assert r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("rf, named", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objx"}}}, "Invalid type"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"dependentSchemas": {"a": {}}}}}, "dependentSchemas"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "name"),
    ({"type": "yaml"}, "response_format.type"),
])
def test_invalid_or_unsupported_schema_is_a_400_naming_it(stack, rf, named):
    with pytest.raises(openai.BadRequestError) as e:
        client(stack["pd"]).chat.completions.create(model=MODEL, messages=ask(0), response_format=rf, max_tokens=5)
    assert named in e.value.message and e.value.body["param"].startswith("response_format")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
@pytest.mark.parametrize("parallel", [True, False])
def test_required_and_named_tool_calls_validate_streamed_and_not(stack, choice, parallel):
    c = client(stack["pd"])
    for i in range(2):
        kw = dict(model=MODEL, messages=ask(i), tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel,
                  max_tokens=120, temperature=1.0, seed=i)
        r = c.chat.completions.create(**kw)
        msg = r.choices[0].message
        single = not parallel or isinstance(choice, dict)
        # One call completes the grammar; with parallel calls a random model may go on calling until
        # max_tokens, and then only its last call can be cut short.
        assert r.choices[0].finish_reason == "tool_calls" or (not single and r.choices[0].finish_reason == "length")
        assert msg.tool_calls and msg.content is None
        complete = msg.tool_calls if r.choices[0].finish_reason == "tool_calls" else msg.tool_calls[:-1]
        for tc in complete:
            assert tc.id.startswith("call_") and tc.type == "function"
            jsonschema.validate(json.loads(tc.function.arguments), PARAMS[tc.function.name])
        if isinstance(choice, dict):
            assert [tc.function.name for tc in msg.tool_calls] == ["get_time"]
        if single:
            assert len(msg.tool_calls) == 1
        content, calls, finish = streamed(c.chat.completions.create(stream=True, **kw))
        assert finish == r.choices[0].finish_reason and content == ""
        assert [(x["name"], x["arguments"]) for x in calls.values()] == [
            (tc.function.name, tc.function.arguments) for tc in msg.tool_calls]
        assert all(x["id"].startswith("call_") for x in calls.values())


def test_a_tool_result_turn_renders_and_answers(stack, qwen_dir):
    from common.tokenizer import Tokenizer

    c = client(stack["pd"])
    first = c.chat.completions.create(model=MODEL, messages=ask(1), tools=TOOLS, tool_choice="required",
                                      parallel_tool_calls=False, max_tokens=120, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = ask(1) + [first.choices[0].message.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    r = c.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The template saw the call (arguments as an object) and the result.
    from router.api.protocol import parse_messages

    text = Tokenizer(qwen_dir).render_chat(parse_messages({"messages": history}), tools=TOOLS)
    assert f'"name": "{call.function.name}", "arguments": {call.function.arguments}' in text
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in text
    assert r.usage.prompt_tokens == len(Tokenizer(qwen_dir).encode(text, add_special_tokens=False))


def test_auto_tool_choice_reads_the_models_format(stack):
    r = client(stack["pd"]).chat.completions.create(model=MODEL, messages=ask(2), tools=TOOLS, max_tokens=10,
                                                    temperature=0)
    # A random model writes no <tool_call>: the reply is content, parsed and passed through.
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.tool_calls is None


def test_auto_tool_choice_without_a_format_uses_the_generic_one(tiny_model_dir, tmp_path):
    """A model whose template has no tool format (the tiny ChatML one): tool_choice auto is served in
    the generic format — the tools described in a system message, the reply free text or calls."""
    from common.tokenizer import Tokenizer
    from router.api.protocol import RequestParser

    worker = start_worker("both", tiny_model_dir, tmp_path)
    router = start_router(tiny_model_dir, tmp_path, "--served-model-name", "tiny", "--colocated", address(worker))
    try:
        c = openai.OpenAI(base_url=base_url(router) + "/v1", api_key="x", max_retries=0)
        r = c.chat.completions.create(model="tiny", messages=ask(0), tools=TOOLS, max_tokens=12, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
        req = RequestParser(Tokenizer(tiny_model_dir), {"tiny"}, 1024).chat(
            {"model": "tiny", "messages": ask(0), "tools": TOOLS}, "", None)[0]
        prompt = Tokenizer(tiny_model_dir).decode(req.prompt_token_ids, skip_special_tokens=False)
        assert "You can call these functions" in prompt and '"name": "get_weather"' in prompt
        assert req.sampling.grammar is not None and req.reply is not None and req.reply.tools.name == "generic"
        with pytest.raises(openai.BadRequestError) as e:  # two constraints at once: named
            c.chat.completions.create(model="tiny", messages=ask(0), tools=TOOLS, max_tokens=5,
                                      response_format=JSON_SCHEMA)
        assert e.value.body["param"] == "response_format"
    finally:
        stop_all(router, worker)


@pytest.mark.parametrize("kw", [dict(response_format=JSON_SCHEMA, max_tokens=60),
                                dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=120)])
def test_disaggregated_and_colocated_give_identical_constrained_output(stack, kw):
    outs = []
    for router in ("pd", "co"):
        r = client(stack[router]).chat.completions.create(model=MODEL, messages=ask(7), temperature=1.0, seed=21, **kw)
        m = r.choices[0].message
        outs.append((m.content, [(tc.function.name, tc.function.arguments) for tc in m.tool_calls or []]))
    assert outs[0] == outs[1]


LONG = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 3},
                                                   "minItems": 60, "maxItems": 60}},
        "required": ["items"], "additionalProperties": False}


async def test_decode_killed_mid_json_fails_over_and_the_json_validates(qwen_dir, tmp_path):
    from grpc_client import kill_while_decoding

    d0 = start_worker("both", qwen_dir, tmp_path, name="c0", wait=False)
    d1 = start_worker("both", qwen_dir, tmp_path, name="c1", wait=False)
    for w in (d0, d1):
        w.wait_for("worker ready")
    router = start_router(qwen_dir, tmp_path, "--served-model-name", MODEL, "--colocated", address(d0), address(d1))
    try:
        body = {"model": MODEL, "messages": ask(3), "max_tokens": 600, "temperature": 1.0, "seed": 5,
                "response_format": {"type": "json_schema", "json_schema": {"name": "long", "schema": LONG}}}
        async with aiohttp.ClientSession() as s:
            async with s.post(base_url(router) + "/v1/chat/completions", json=body) as r:
                reference = (await r.json())["choices"][0]["message"]["content"]
            jsonschema.validate(json.loads(reference), LONG)
            serving: asyncio.Future[str] = asyncio.get_running_loop().create_future()

            async def read() -> str:
                async with s.post(base_url(router) + "/v1/chat/completions", json={**body, "stream": True}) as r:
                    serving.set_result(r.headers["X-Splitfire-Decode"])
                    text = ""
                    async for line in r.content:
                        if line.startswith(b"data: {"):
                            ev = json.loads(line[6:])
                            assert "error" not in ev, ev
                            text += ev["choices"][0]["delta"].get("content") or "" if ev["choices"] else ""
                    return text

            reader = asyncio.create_task(read())
            victim = d0 if address(d0) == await serving else d1
            killed = await kill_while_decoding(victim, 560)
            text = await reader
        assert killed
        # The replacement worker resumed the grammar (and the seed) where the dead one stopped.
        assert text == reference
        jsonschema.validate(json.loads(text), LONG)
    finally:
        stop_all(router, d0, d1)


RESPONSE_TOOLS = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
                   "parameters": t["function"]["parameters"], "strict": True} for t in TOOLS]


def test_responses_api_text_structured_output_and_function_calls(stack):
    """client.responses.create, through the SDK's own types: plain text, text.format json_schema,
    a required function call and its function_call_output round trip; streamed events add up to
    the same response as the non-streamed one."""
    c = client(stack["pd"])
    plain = c.responses.create(model=MODEL, input="Say something", instructions="Be brief", max_output_tokens=8,
                               temperature=0)
    assert plain.object == "response" and plain.status == "incomplete"  # 8 tokens of a random model
    assert plain.incomplete_details.reason == "max_output_tokens" and plain.output_text
    assert plain.usage.output_tokens == 8 and plain.usage.input_tokens > 0
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}}
    structured = c.responses.create(model=MODEL, input=ask(1), text=fmt, max_output_tokens=60, temperature=0)
    assert structured.status == "completed"
    jsonschema.validate(json.loads(structured.output_text), ANSWER)
    called = c.responses.create(model=MODEL, input=ask(2), tools=RESPONSE_TOOLS, tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=120, temperature=0)
    assert called.status == "completed"
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and all(call.name in PARAMS for call in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), PARAMS[call.name])
    follow_up = ask(2) + [{"type": "function_call", "call_id": call.call_id, "name": call.name,
                           "arguments": call.arguments} for call in calls]
    follow_up += [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"} for call in calls]
    answer = c.responses.create(model=MODEL, input=follow_up, tools=RESPONSE_TOOLS, tool_choice="none",
                                max_output_tokens=10, temperature=0)
    base = c.responses.create(model=MODEL, input=ask(2), tools=RESPONSE_TOOLS, tool_choice="none", max_output_tokens=1)
    assert answer.output and answer.output[0].type == "message"
    assert answer.usage.input_tokens > base.usage.input_tokens + 10  # the call and its output were rendered
    # Streaming: the official event sequence, adding up to the non-streamed response.
    types, text, args = [], "", {}
    with c.responses.stream(model=MODEL, input=ask(2), tools=RESPONSE_TOOLS, tool_choice="required",
                            parallel_tool_calls=False, max_output_tokens=120, temperature=0) as stream:
        for ev in stream:
            types.append(ev.type)
            if ev.type == "response.function_call_arguments.delta":
                args[ev.item_id] = args.get(ev.item_id, "") + ev.delta
            text += ev.delta if ev.type == "response.output_text.delta" else ""
        final = stream.get_final_response()
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert "response.output_item.added" in types and "response.function_call_arguments.done" in types
    streamed_calls = [item for item in final.output if item.type == "function_call"]
    assert [(x.name, x.arguments) for x in streamed_calls] == [(x.name, x.arguments) for x in calls]
    assert sorted(args.values()) == sorted(x.arguments for x in calls)
    for bad in ({"previous_response_id": "resp_1"}, {"store": True}, {"tools": [{"type": "web_search"}]},
                {"extra_body": {"frobnicate": 1}}):
        with pytest.raises(openai.BadRequestError):
            c.responses.create(model=MODEL, input="hi", **bad)


# -- Anthropic's Messages API, through the official `anthropic` SDK ---------------------------------

GREEDY = {"temperature": 0}  # (the current anthropic SDK has no temperature argument; the API still takes it)
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]


def messages_client(router, key: str = "unused"):
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=base_url(router), api_key=key, max_retries=0)


@pytest.mark.parametrize("route", ["pd", "co"])
def test_messages_answer_as_the_chat_route_does_streamed_and_not(stack, route):
    m, c = messages_client(stack[route]), client(stack[route])
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief"}, *ask(3)],
                                     max_tokens=8, extra_body=GREEDY)
    msg = m.messages.create(model=MODEL, system="Be brief", messages=ask(3), max_tokens=8, extra_body=GREEDY)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == chat.choices[0].message.content
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    u = msg.usage
    assert u.output_tokens == 8 and u.input_tokens + u.cache_read_input_tokens == chat.usage.prompt_tokens
    assert m.messages.count_tokens(model=MODEL, system="Be brief", messages=ask(3)).input_tokens == \
        chat.usage.prompt_tokens
    # Streaming, through the SDK's stream helper: Anthropic's event order, the same message.
    types = []
    with m.messages.stream(model=MODEL, system="Be brief", messages=ask(3), max_tokens=8, extra_body=GREEDY) as s:
        for ev in s:
            types.append(ev.type)
        final = s.get_final_message()
    assert types[0] == "message_start" and types[-1] == "message_stop" and "message_delta" in types
    assert types.index("content_block_start") < types.index("content_block_stop") < types.index("message_delta")
    assert final.content[0].text == msg.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 8


@pytest.mark.parametrize("route", ["pd", "co"])
def test_messages_tool_loop_on_a_model_with_a_native_tool_format(stack, route):
    m = messages_client(stack[route])
    first = m.messages.create(model=MODEL, messages=ask(4), tools=ANTHROPIC_TOOLS, max_tokens=120, extra_body=GREEDY,
                              tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert first.stop_reason == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name in PARAMS
    jsonschema.validate(uses[0].input, PARAMS[uses[0].name])
    named = m.messages.create(model=MODEL, messages=ask(4), tools=ANTHROPIC_TOOLS, max_tokens=120, extra_body=GREEDY,
                              tool_choice={"type": "tool", "name": "get_time"})
    assert [b.name for b in named.content if b.type == "tool_use"] == ["get_time"]
    history = [*ask(4), {"role": "assistant", "content": [b.model_dump() for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                             "content": "sunny, 21 C"}]}]
    answer = m.messages.create(model=MODEL, messages=history, tools=ANTHROPIC_TOOLS, max_tokens=6, extra_body=GREEDY,
                               tool_choice={"type": "none"})
    assert [b.type for b in answer.content] == ["text"] and answer.stop_reason in ("end_turn", "max_tokens")
    none = {"type": "none"}  # (tools the model may not call are not rendered: as on the chat route)
    before = m.messages.count_tokens(model=MODEL, messages=ask(4), tools=ANTHROPIC_TOOLS, tool_choice=none).input_tokens
    after = m.messages.count_tokens(model=MODEL, messages=history, tools=ANTHROPIC_TOOLS, tool_choice=none).input_tokens
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == after > before + 10
    # Streamed: the tool_use block's input arrives as input_json_delta fragments.
    with m.messages.stream(model=MODEL, messages=ask(4), tools=ANTHROPIC_TOOLS, max_tokens=120, extra_body=GREEDY,
                           tool_choice={"type": "any", "disable_parallel_tool_use": True}) as s:
        kinds = [ev.delta.type for ev in s if ev.type == "content_block_delta"]
        streamed = s.get_final_message()
    assert "input_json_delta" in kinds and streamed.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(uses[0].name, uses[0].input)]


def test_messages_on_a_model_without_a_tool_format_keys_and_errors(tiny_model_dir, tmp_path):
    """The tiny ChatML model has no tool format: the generic one serves a tool loop. x-api-key maps to the
    key's tenant; errors are the SDK's typed exceptions; what cannot be honoured is a 400 naming it."""
    anthropic = pytest.importorskip("anthropic")
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": {"sk-ant": {"tenant": "a"}}}))
    worker = start_worker("both", tiny_model_dir, tmp_path)
    router = start_router(tiny_model_dir, tmp_path, "--served-model-name", "tiny", "--colocated", address(worker),
                          "--api-keys", str(keys))
    try:
        m = messages_client(router, "sk-ant")
        first = m.messages.create(model="tiny", messages=ask(5), tools=ANTHROPIC_TOOLS, max_tokens=120,
                                  extra_body=GREEDY, tool_choice={"type": "any", "disable_parallel_tool_use": True})
        uses = [b for b in first.content if b.type == "tool_use"]
        assert first.stop_reason == "tool_use" and len(uses) == 1
        jsonschema.validate(uses[0].input, PARAMS[uses[0].name])
        history = [*ask(5), {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "21 C",
                                                 "is_error": False}, {"type": "text", "text": "And now?"}]}]
        answer = m.messages.create(model="tiny", messages=history, max_tokens=4, extra_body=GREEDY)
        assert answer.content[0].type == "text" and answer.usage.output_tokens == 4
        # A stop sequence taken from the greedy answer (a run of letters in it) ends it there, and is named.
        text = m.messages.create(model="tiny", messages=ask(6), max_tokens=16, extra_body=GREEDY).content[0].text
        stop = re.search(r"[A-Za-z0-9]{2,}", text[1:])
        assert stop is not None, text
        cut = m.messages.create(model="tiny", messages=ask(6), max_tokens=16, extra_body=GREEDY,
                                stop_sequences=["never-seen", stop.group()])
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop.group(), (text, cut)
        assert cut.content[0].text == text[:text.index(stop.group())]
        with pytest.raises(anthropic.AuthenticationError):
            messages_client(router, "sk-wrong").messages.create(model="tiny", messages=ask(0), max_tokens=2)
        with pytest.raises(anthropic.NotFoundError):
            m.messages.create(model="nope", messages=ask(0), max_tokens=2)
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
        for kw, param in ((dict(messages=[{"role": "user", "content": [image]}]), "messages[0].content[0]"),
                          (dict(messages=ask(0), tools=[{"type": "web_search_20250305", "name": "web_search"}]),
                           "tools[0]"),
                          (dict(messages=ask(0), thinking={"type": "enabled", "budget_tokens": 1024}), "thinking"),
                          (dict(messages=ask(0), extra_body={"frobnicate": 1}), "frobnicate")):
            with pytest.raises(anthropic.BadRequestError) as e:
                m.messages.create(model="tiny", max_tokens=2, **kw)
            assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
            assert param in e.value.body["error"]["message"], (param, e.value.body)
        async def missing_max_tokens() -> tuple[int, dict]:
            async with aiohttp.ClientSession() as s, s.post(base_url(router) + "/v1/messages",
                                                            headers={"x-api-key": "sk-ant",
                                                                     "anthropic-version": "2023-06-01"},
                                                            json={"model": "tiny", "messages": ask(0)}) as r:
                return r.status, await r.json()

        status, body = asyncio.run(missing_max_tokens())
        assert status == 400 and body == {"type": "error", "error": {"type": "invalid_request_error",
                                                                     "message": "max_tokens: Field required"}}
    finally:
        stop_all(router, worker)
