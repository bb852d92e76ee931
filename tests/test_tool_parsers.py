"""Reading tool calls and reasoning out of replies in each model family's format: recorded
outputs, whole and streamed in pieces split at every character, give the same calls and text."""

from __future__ import annotations

import json

import pytest

from router.api.reply import Reasoning, ReplyPlan
from router.api.tool_calls import (
    HERMES,
    JSON_ARRAY,
    LLAMA3_JSON,
    CallArgs,
    CallStart,
    Content,
    detect_format,
    mistral_format,
    parse_reply,
)

TOOL_CALLS_TOKEN = 9

# (format, reply text, first token ids, expected content, expected [(name, arguments object)])
RECORDED = [
    ("hermes-qwen2.5", HERMES,
     '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n</tool_call>',
     None, None, [("get_current_temperature", {"location": "San Francisco, CA, USA"})]),
    ("hermes-parallel-with-preamble", HERMES,
     'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
     '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET", "note": "a } in a string \\" ok"}}\n'
     '</tool_call>',
     None, "Let me check both.",
     [("get_weather", {"city": "Paris", "days": [1, 2]}), ("get_time", {"zone": "CET", "note": 'a } in a string " ok'})]),
    ("hermes-plain-answer", HERMES, "The capital of France is Paris. I used <b>no</b> tools.", None,
     "The capital of France is Paris. I used <b>no</b> tools.", []),
    ("hermes-keys-reversed", HERMES, '<tool_call>\n{"arguments": {"q": "x"}, "name": "search"}\n</tool_call>', None,
     None, [("search", {"q": "x"})]),
    ("llama3.1-json", LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Tokyo", "unit": "celsius"}}', None,
     None, [("get_weather", {"city": "Tokyo", "unit": "celsius"})]),
    ("llama3.1-plain", LLAMA3_JSON, "Sure: {braces} are fine in text.", None, "Sure: {braces} are fine in text.", []),
    ("mistral-v3", mistral_format(TOOL_CALLS_TOKEN),
     '[{"name": "get_weather", "arguments": {"city": "Berlin"}}, {"name": "get_time", "arguments": {"zone": "CET"}}]',
     [TOOL_CALLS_TOKEN, 100], None, [("get_weather", {"city": "Berlin"}), ("get_time", {"zone": "CET"})]),
    ("mistral-plain", mistral_format(TOOL_CALLS_TOKEN), "[1, 2] is a list.", [100], "[1, 2] is a list.", []),
    ("json-array", JSON_ARRAY, '[{"name": "get_time", "arguments": {"zone": "UTC"}}]', None, None,
     [("get_time", {"zone": "UTC"})]),
]


def run(fmt, text: str, ids, pieces: list[str]):
    ex = fmt.extractor()
    events = []
    for k, piece in enumerate(pieces):
        events += ex.feed(piece, ids if k == 0 else None)
    events += ex.close()
    return events, ex.calls


def splits(text: str):
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


@pytest.mark.parametrize("name, fmt, text, ids, content, calls", RECORDED, ids=[r[0] for r in RECORDED])
def test_recorded_replies_parse_whole_and_split_anywhere(name, fmt, text, ids, content, calls):
    whole = parse_reply(fmt, text, ids)
    assert whole.content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == calls
    for pieces in splits(text):
        events, got = run(fmt, text, ids, pieces)
        assert [(c.name, json.loads(c.arguments)) for c in got] == calls, pieces
        streamed_content = "".join(e.text for e in events if isinstance(e, Content))
        assert (streamed_content or None if calls else streamed_content) == content, pieces
        # The stream names each call once, before its arguments, which add up to the final text.
        for i, call in enumerate(got):
            starts = [e for e in events if isinstance(e, CallStart) and e.index == i]
            assert [(s.id, s.name) for s in starts] == [(call.id, call.name)]
            first_arg = next(k for k, e in enumerate(events) if isinstance(e, CallArgs) and e.index == i)
            assert events.index(starts[0]) < first_arg
            assert "".join(e.fragment for e in events if isinstance(e, CallArgs) and e.index == i) == call.arguments


def test_a_call_cut_off_by_max_tokens_stays_a_call_with_partial_arguments():
    r = parse_reply(HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    assert [(c.name, c.arguments) for c in r.tool_calls] == [("get_weather", '{"city": "Par')]


def test_ids_follow_each_format():
    assert parse_reply(HERMES, RECORDED[0][2]).tool_calls[0].id.startswith("call_")
    mid = parse_reply(mistral_format(TOOL_CALLS_TOKEN), RECORDED[6][2], [TOOL_CALLS_TOKEN]).tool_calls[0].id
    assert len(mid) == 9 and mid.isalnum()  # Mistral's template refuses any other tool_call_id


def test_formats_are_read_off_chat_templates():
    ids = {"[TOOL_CALLS]": 5}.get
    assert detect_format("{% if tools %}<tool_call>{% endif %}", ids) is HERMES
    assert detect_format("{{ '[TOOL_CALLS]' }}", ids).open_token == 5
    assert detect_format("<|python_tag|>{{ x }}", ids) is LLAMA3_JSON
    assert detect_format("<|im_start|>{{ m.content }}", ids) is None
    assert detect_format(None, ids) is None


THINKING = "<think>\nThe user wants the weather; call the tool.\n</think>\n\n<tool_call>\n" \
           '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


@pytest.mark.parametrize("opened", [False, True])
def test_reasoning_then_a_call_splits_into_reasoning_and_tool_call(opened):
    text = THINKING.removeprefix("<think>") if opened else THINKING
    plan = ReplyPlan(HERMES, reasoning=True, reasoning_open=opened)
    for pieces in splits(text):
        p = plan.parser()
        events = []
        for piece in pieces:
            events += p.feed(piece)
        events += p.close()
        assert "".join(e.text for e in events if isinstance(e, Reasoning)) == "The user wants the weather; call the tool."
        assert not [e for e in events if isinstance(e, Content)]
        assert [(c.name, c.arguments) for c in p.calls] == [("get_weather", '{"city": "Oslo"}')]


def test_a_reply_without_thinking_is_all_content():
    p = ReplyPlan(None, reasoning=True).parser()
    events = p.feed("Plain answer, no <think> here.") + p.close()
    assert events == [Content("Plain answer, no <think> here.")]


def _matcher(grammar_text: str, tokenizer_dir):
    import llguidance

    from common.tokenizer import Tokenizer

    tok = Tokenizer(tokenizer_dir)
    llt = llguidance.LLTokenizer((tokenizer_dir / "tokenizer.json").read_text(), n_vocab=tok.vocab_size,
                                 eos_token=sorted(tok.eos_token_ids))
    return tok, llguidance.LLMatcher(llt, grammar_text, log_level=0)


def test_the_generic_auto_grammar_is_free_text_or_calls(tiny_model_dir):
    """A model without a tool format of its own, under tool_choice auto: any text that does not open with
    `[`, or a list of calls whose JSON the schema shapes from its first token."""
    from router.api.tool_calls import GENERIC, Tool, ToolChoice

    weather = Tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}},
                                   "required": ["city"], "additionalProperties": False})
    g = GENERIC.auto_grammar(ToolChoice("auto", (weather,), parallel=True))
    cases = {
        "The capital of France is Paris. <b>HTML</b>, [links] and {json} are fine.": True,
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}]': True,
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_weather", "arguments": '
        '{"city": "Oslo"}}]': True,
        '[{"name": "get_time", "arguments": {}}]': False,  # not a tool
        '[{"name": "get_weather", "arguments": {"town": "Paris"}}]': False,  # not its schema
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}] and more': False,  # the list ends the reply
        " [1] a reply opening with a bracket is read as calls, so it must be calls": False,
    }
    for text, ok in cases.items():
        tok, m = _matcher(g, tiny_model_dir)
        consumed = m.consume_tokens(tok.encode(text, add_special_tokens=False))
        assert (consumed and m.is_accepting()) == ok, text
    parsed = parse_reply(GENERIC, list(cases)[2])
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_weather", {"city": "Paris"}),
                                                                           ("get_weather", {"city": "Oslo"})]


@pytest.mark.slow
def test_free_text_under_the_generic_auto_grammar_is_unchanged(smollm2_dir):
    """The union grammar leaves prose alone: SmolLM2's greedy answers with it equal the unconstrained
    ones, token for token (the grammar's only other effect is keeping the bytes valid UTF-8, which a
    trained model's prose is anyway)."""
    from engine_helpers import make_engine

    from common.sampling_params import SamplingParams
    from router.api.tool_calls import GENERIC, Tool, ToolChoice

    g = GENERIC.auto_grammar(ToolChoice("auto", (Tool("get_weather", {"type": "object"}),), parallel=False))
    engine = make_engine(smollm2_dir, kv_cache_gb=0.05)
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
                 "Explain what a <div> tag is in HTML."]
    for i, q in enumerate(questions):
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": q}])
        engine.add_request(f"free{i}", ids, SamplingParams(max_tokens=40, temperature=0))
        engine.add_request(f"tools{i}", ids, SamplingParams(max_tokens=40, temperature=0, grammar=g))
        # As the router sends it: the grammar released once the reply has opened as prose.
        engine.add_request(f"released{i}", ids, SamplingParams(max_tokens=40, temperature=0, grammar=g,
                                                               grammar_release="["))
    released: dict[str, bool] = {}  # once a reply has 3 tokens: is its matcher gone?
    held: dict[str, bool] = {}
    outputs: dict[str, list[int]] = {}
    while engine.has_work:
        for o in engine.step():
            outputs.setdefault(o.request_id, []).extend(o.token_ids)
        for rid, seq in engine.seqs.items():
            if len(seq.output_token_ids) >= 3:
                (released if rid.startswith("released") else held).setdefault(rid, seq.matcher is None)
    assert released == {f"released{i}": True for i in range(len(questions))}
    assert {k: v for k, v in held.items() if k.startswith("tools")} == {f"tools{i}": False for i in range(len(questions))}
    for i in range(len(questions)):
        assert outputs[f"tools{i}"] == outputs[f"free{i}"] == outputs[f"released{i}"], questions[i]


# -- the DeepSeek and Kimi families' marked formats ------------------------------------------------

from router.api.marked_calls import DEEPSEEK_V3, DEEPSEEK_V31, KIMI_K2, detect_marked  # noqa: E402

MARKED = [
    ("deepseek-v3", DEEPSEEK_V3,
     "Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
     '{"city": "Paris", "days": [1, 2]}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n'
     '```json\n{"zone": "a } and ``` in a string"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     "Let me look.", [("get_weather", {"city": "Paris", "days": [1, 2]}), ("get_time", {"zone": "a } and ``` in a string"})]),
    ("deepseek-v3.1", DEEPSEEK_V31,
     '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo"}<｜tool▁call▁end｜>'
     "<｜tool▁calls▁end｜>", None, [("get_weather", {"city": "Oslo"})]),
    ("kimi-k2", KIMI_K2,
     '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
     '{"city": "Kyiv"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>'
     '{"zone": "EET"}<|tool_call_end|><|tool_calls_section_end|>',
     None, [("get_weather", {"city": "Kyiv"}), ("get_time", {"zone": "EET"})]),
    ("deepseek-plain", DEEPSEEK_V3, "Paris is the capital. <b>no</b> tools; a fence ```json {} ``` is text.",
     "Paris is the capital. <b>no</b> tools; a fence ```json {} ``` is text.", []),
]


def _marked(fmt, pieces):
    ex = fmt.extractor()
    events = []
    for piece in pieces:
        events += ex.feed(piece)
    return events + ex.close(), ex.calls


@pytest.mark.parametrize("name, fmt, text, content, calls", MARKED, ids=[m[0] for m in MARKED])
def test_marked_formats_parse_whole_and_split_anywhere(name, fmt, text, content, calls):
    for pieces in splits(text):
        events, got = _marked(fmt, pieces)
        assert [(c.name, json.loads(c.arguments)) for c in got] == calls, pieces
        streamed = "".join(e.text for e in events if isinstance(e, Content))
        assert (streamed or None) == content, pieces
        for i, call in enumerate(got):
            starts = [e for e in events if isinstance(e, CallStart) and e.index == i]
            assert [(s.id, s.name) for s in starts] == [(call.id, call.name)]
            assert "".join(e.fragment for e in events if isinstance(e, CallArgs) and e.index == i) == call.arguments
    if fmt is KIMI_K2:  # Kimi's call ids are its own `functions.NAME:INDEX`
        assert [c.id for c in _marked(fmt, [text])[1]] == ["functions.get_weather:0", "functions.get_time:1"]


def test_marked_formats_are_read_off_chat_templates():
    ids = {"<｜tool▁calls▁begin｜>": 7, "<|tool_calls_section_begin|>": 9}.get
    v3 = "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' }}"
    v31 = "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>' + args }}"
    kimi = "{{ '<|tool_calls_section_begin|>' }}{% for tc in message.tool_calls %}..."
    assert detect_marked(v3, ids).name == "deepseek_v3"
    assert detect_marked(v31, ids).name == "deepseek_v31"
    assert detect_marked(kimi, ids).name == "kimi_k2" and dict(detect_marked(kimi, ids).marker_ids) == {
        "<|tool_calls_section_begin|>": 9}
    assert detect_marked("<|im_start|>{{ m.content }}", ids) is None


DS_MARKERS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
              "<｜tool▁sep｜>")
KIMI_MARKERS = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                "<|tool_call_end|>", "<|tool_call_argument_begin|>")
DS_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
               "{% if tools %}{# <｜tool▁calls▁begin｜> function<｜tool▁sep｜> ```json #}{% endif %}<|im_start|>assistant\n")
KIMI_TEMPLATE = DS_TEMPLATE.replace("<｜tool▁calls▁begin｜> function<｜tool▁sep｜> ```json", "<|tool_calls_section_begin|>")


@pytest.mark.parametrize("markers, template, name", [(DS_MARKERS, DS_TEMPLATE, "deepseek_v3"),
                                                     (KIMI_MARKERS, KIMI_TEMPLATE, "kimi_k2")])
def test_constrained_marked_calls_parse_from_the_reply_token_ids(tmp_path, markers, template, name):
    """A model whose vocabulary has the markers as special tokens: under tool_choice required the grammar
    writes them as tokens; the worker's text drops them; the router reads the reply back from its token ids
    and gets schema-valid calls, whole and streamed a token at a time."""
    import jsonschema
    from engine_helpers import drain, make_engine
    from tiny_model import make_tiny_llama

    from common.tokenizer import Tokenizer
    from router.api.protocol import RequestParser

    model = make_tiny_llama(tmp_path / "m", extra_special=markers)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
               "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}]
    parser = RequestParser(Tokenizer(model), {"m"}, 1024)
    assert parser.tool_format.name == name
    req = parser.chat({"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools,
                       "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 60}, "", None)[0]
    engine = make_engine(model)
    engine.add_request("r", req.prompt_token_ids, req.sampling)
    out = drain(engine)["r"]
    assert not any(m in out.text for m in markers)  # (what the worker's text carries)
    for pieces in ([out.token_ids], [[t] for t in out.token_ids]):
        p = req.reply.parser()
        events = []
        for ids in pieces:
            events += p.feed("", ids)
        events += p.close()
        assert [c.name for c in p.calls] == ["get_weather"], events
        jsonschema.validate(json.loads(p.calls[0].arguments), weather)


def test_reasoning_before_a_marked_call_stays_reasoning():
    """DeepSeek-R1: the `<think>` block before the calls is reasoning_content, the calls are calls."""
    text = ("<think>\nThe user wants the weather.\n</think>\n\n" + MARKED[0][2].removeprefix("Let me look."))
    for pieces in splits(text):
        p = ReplyPlan(DEEPSEEK_V3, reasoning=True).parser()
        events = []
        for piece in pieces:
            events += p.feed(piece)
        events += p.close()
        assert "".join(e.text for e in events if isinstance(e, Reasoning)) == "The user wants the weather."
        assert not "".join(e.text for e in events if isinstance(e, Content)).strip()
        assert [c.name for c in p.calls] == ["get_weather", "get_time"]
