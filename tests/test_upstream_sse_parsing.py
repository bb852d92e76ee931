"""Parsing OpenAI-compatible SSE from upstreams: the fast paths give the same text as full JSON."""

from __future__ import annotations

import json

from router.backends.openai_upstream import _batch_text, _fast_text


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
    # Reasoning (and tool calls, logprobs) must reach the client: such events take the full parse.
    reasoning = _event({"reasoning_content": "think", "content": "say"})
    assert _fast_text(reasoning[6:]) is None
    from router.backends.openai_upstream import parse_events

    c, _ = parse_events(reasoning)
    assert c.text == "say" and c.extra == {"reasoning_content": "think"}


def test_read_with_a_finish_parses_like_json_whatever_the_spacing():
    from router.backends.openai_upstream import parse_events

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


def _stream(rng, texts: list[str], spaced: bool = False) -> bytes:
    """An upstream's SSE body: role event, one event per text (the odd reasoning delta and
    keep-alive comment among them), finish, usage, [DONE]."""
    sep = (", ", ": ") if spaced else (",", ":")

    def ev(obj: dict) -> bytes:
        return b"data: " + json.dumps(obj, ensure_ascii=rng.random() < 0.5, separators=sep).encode() + b"\n\n"

    base = {"id": "chatcmpl-7", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    out = [ev({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}]})]
    for t in texts:
        if rng.random() < 0.05:
            out.append(ev({**base, "choices": [{"index": 0, "delta": {"reasoning_content": "hm"},
                                                "logprobs": None, "finish_reason": None}]}))
        if rng.random() < 0.05:
            out.append(b": keep-alive\n\n")
        out.append(ev({**base, "choices": [{"index": 0, "delta": {"content": t}, "logprobs": None,
                                            "finish_reason": None}]}))
    out.append(ev({**base, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}]}))
    out.append(ev({**base, "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": len(texts),
                                                    "total_tokens": 9 + len(texts)}}))
    return b"".join(out) + b"data: [DONE]\n\n"


def test_framed_fast_path_gives_the_text_full_parsing_gives(monkeypatch):
    """Random texts (quotes, backslashes, escapes, non-ASCII, empty), random read boundaries:
    the learned-frame path and full parsing must agree, and the frame must carry most reads."""
    import random

    from router.backends import openai_upstream as ou

    full_parses = 0
    real = ou.parse_events

    def counting(*args):
        nonlocal full_parses
        full_parses += 1
        return real(*args)

    monkeypatch.setattr(ou, "parse_events", counting)
    rng = random.Random(7)
    alphabet = ["a", "b ", "é", "日本", "🚀", '"', "\\", "\n", "\t", "\\n", "data: ", '"}', "\u2028", ""]
    for trial in range(300):
        texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 4))) for _ in range(rng.randint(1, 60))]
        body = _stream(rng, texts, spaced=trial % 10 == 9)
        cuts = sorted(rng.sample(range(1, len(body)), min(len(body) - 1, rng.randint(1, 40))))
        p = ou.EventParser()
        text, finish, usage, done, reasoning = "", None, None, False, ""
        for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True):
            c, d = p.feed(body[a:b])
            if c is not None:
                text += c.text
                reasoning += (c.extra or {}).get("reasoning_content", "")
                finish = c.finish_reason or finish
                usage = (c.prompt_tokens, c.completion_tokens) if c.completion_tokens else usage
            if d:
                done = True
                break
        assert done and text == "".join(texts) and finish == "length", trial
        assert reasoning == "hm" * body.count(b'"reasoning_content"'), trial  # (never taken for a framed read)
        assert usage == (9, len(texts)), trial
    # A plain stream read event by event (68 reads): only the role event, the first delta (where
    # the frame is learned) and finish, usage and [DONE] need full parsing.
    plain = _stream(random.Random(1), ["tok "] * 64).replace(b": keep-alive\n\n", b"")
    plain = b"".join(e + b"\n\n" for e in plain.split(b"\n\n") if b"reasoning" not in e and e)
    full_parses = 0
    p = ou.EventParser()
    reads = plain.split(b"\n\n")[:-1]
    for e in reads:
        p.feed(e + b"\n\n")
    assert len(reads) == 68 and full_parses == 5
