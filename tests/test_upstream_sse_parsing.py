"""Parsing OpenAI-compatible SSE from upstreams: the fast paths give the same text as full JSON."""

from __future__ import annotations

import json

from router.openai_upstream import _batch_text, _fast_text


def _event(delta: dict, finish=None, usage=None) -> bytes:
    obj = {"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta,
                                                                      "logprobs": None, "finish_reason": finish}]}
    obj["usage"] = usage  # vLLM sends "usage": null on every chunk when include_usage is set
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def test_batch_of_plain_deltas_decodes_like_json():
    texts = ['hé "quoted" \\ back', "\n日本\t", "🚀"]
    blob = b"\n\n".join(_event({"content": t}) for t in texts)
    assert _batch_text(blob) == "".join(texts)


def test_events_that_need_a_closer_look_are_left_to_full_parsing():
    role = _event({"role": "assistant", "content": ""})
    assert _batch_text(role + b"\n\n" + _event({"content": "a"})) == "a"
    assert _batch_text(_event({"role": "assistant"})) is None  # no content field
    assert _batch_text(_event({}, finish="stop")) is None
    assert _batch_text(_event({}, usage={"prompt_tokens": 3, "completion_tokens": 2})) is None
    assert _batch_text(_event({"content": None})) is None
    assert _batch_text(b"data: [DONE]") is None


def test_single_event_fast_path():
    assert _fast_text(_event({"content": 'x"y'})[6:]) == 'x"y'
    assert _fast_text(_event({"content": "x"}, finish="length")[6:]) is None
    assert _fast_text(_event({"reasoning_content": "think", "content": "say"})[6:]) == "say"


def test_read_with_a_finish_parses_like_json_whatever_the_spacing():
    from router.openai_upstream import parse_events

    plain = [_event({"content": t}) for t in ("a", "b\u00e9", '"c"')]
    finish = {"id": "x", "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
              "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}
    for sep in ((",", ":"), (", ", ": ")):
        blob = b"\n\n".join([*plain, b"data: " + json.dumps(finish, separators=sep).encode(), b"data: [DONE]"])
        c, done = parse_events(blob)
        assert done and c.text == 'ab\u00e9"c"' and c.finish_reason == "length"
        assert (c.prompt_tokens, c.completion_tokens) == (5, 3)
    c, done = parse_events(b"\n\n".join(plain))
    assert not done and c.text == 'ab\u00e9"c"' and c.finish_reason is None
