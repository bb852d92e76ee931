"""Rewriting worker output into OpenAI responses: SSE chunks and whole JSON bodies.

The per-chunk path is hot, so a stream's constant JSON is rendered once into byte
prefixes and each chunk is `prefix + json-escaped text + suffix`: no dict building or
full JSON serialisation per token.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from common.tokenizer import Tokenizer
from router.api.chunks import Chunk, Logprob
from router.api.protocol import GenRequest
from router.api.reply import Reasoning, ReplyEvent
from router.api.tool_calls import CallStart, Content

DONE = b"data: [DONE]\n\n"
compact_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode  # UTF-8 as is, no spaces


class ChoiceWriter(Protocol):
    """Renders one choice of a streamed reply as it arrives."""

    def role(self) -> bytes: ...

    def text(self, text: str, logprobs: list[Logprob] | None = None) -> bytes: ...

    def events(self, events: list[ReplyEvent], logprobs: list[Logprob] | None = None) -> bytes: ...

    def passthrough(self, text: str, extra: dict[str, Any] | None, logprobs: dict[str, Any] | None) -> bytes: ...

    def finish(self, reason: str, last: Chunk) -> bytes: ...

    def usage(self, usage: dict[str, Any]) -> bytes: ...


class ReplyFormat(Protocol):
    """How a route writes its replies: OpenAI chat/completions chunks (`OpenAIFormat`), or the
    Responses API's events (`responses.ResponsesFormat`). The serving path is the same for both."""

    done: bytes  # the stream's last bytes

    def writers(self, reqs: list[GenRequest]) -> list[ChoiceWriter]: ...

    def opening(self, reqs: list[GenRequest], writers: list[ChoiceWriter], early: bool) -> bytes:
        """What a stream starts with: before the first token, or at once with early headers."""
        ...

    def error(self, message: str, type_: str, code: str) -> bytes:
        """A stream's final error event (the failure came after the head was sent)."""
        ...

    def body(self, reqs: list[GenRequest], results: list[dict[str, Any]]) -> dict[str, Any]:
        """The whole reply of a request that did not stream."""
        ...


class OpenAIFormat:
    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self.done = DONE

    def writers(self, reqs: list[GenRequest]) -> list[ChoiceWriter]:
        return [StreamWriter(r, r.model, self.tokenizer) for r in reqs]

    def opening(self, reqs: list[GenRequest], writers: list[ChoiceWriter], early: bool) -> bytes:
        if reqs[0].kind == "chat":
            return b"".join(w.role() for w in writers)
        return b": started\n\n" if early else b""  # (early: the head leaves with the first body bytes)

    def error(self, message: str, type_: str, code: str) -> bytes:
        return error_event(message, type_, code)

    def body(self, reqs: list[GenRequest], results: list[dict[str, Any]]) -> dict[str, Any]:
        return full_response(reqs, reqs[0].model, results, self.tokenizer)


class StreamWriter:
    """Renders one choice's SSE chunks for one request."""

    def __init__(self, req: GenRequest, model: str, tokenizer: Tokenizer | None):
        self.req = req
        self.tokenizer = tokenizer
        head = {"id": req.id, "object": "chat.completion.chunk" if req.kind == "chat" else "text_completion",
                "created": req.created, "model": model}
        h = compact_json(head)[:-1]  # drop the closing brace
        self.head = h
        i = req.prompt_index
        if req.kind == "chat":
            self._pre = f'data: {h},"choices":[{{"index":{i},"delta":{{"content":'.encode()
            self._post = b'},"logprobs":null,"finish_reason":null}]}\n\n'
        else:
            self._pre = f'data: {h},"choices":[{{"index":{i},"text":'.encode()
            self._post = b',"logprobs":null,"finish_reason":null}]}\n\n'

    def role(self) -> bytes:
        return f'data: {self.head},"choices":[{{"index":{self.req.prompt_index},"delta":{{"role":"assistant","content":""}},"logprobs":null,"finish_reason":null}}]}}\n\n'.encode()

    def text(self, text: str, logprobs: list[Logprob] | None = None) -> bytes:
        if logprobs and self.req.want_logprobs:
            return self._choice(text, None, logprobs)
        return self._pre + compact_json(text).encode() + self._post

    def _choice(self, text: str, finish: str | None, logprobs: list[Logprob] | None) -> bytes:
        lp = render_logprobs(self.req, self.tokenizer, logprobs or [], 0) if (logprobs and self.req.want_logprobs) else None
        i = self.req.prompt_index
        if self.req.kind == "chat":
            choice = {"index": i, "delta": {"content": text} if text else {}, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": finish}
        return f"data: {self.head},\"choices\":[{compact_json(choice)}]}}\n\n".encode()

    def finish(self, reason: str, last: Chunk | None = None) -> bytes:
        return self._choice("", reason, None)

    def events(self, events: list[ReplyEvent], logprobs: list[Logprob] | None = None) -> bytes:
        """A parsed reply's deltas (reasoning, content, tool-call starts and argument fragments), one
        chunk each in OpenAI's shapes; logprobs ride on the first."""
        lp = render_logprobs(self.req, self.tokenizer, logprobs, 0) if (logprobs and self.req.want_logprobs) else None
        parts = []
        for e in events:
            if isinstance(e, Content):
                delta: dict[str, Any] = {"content": e.text}
            elif isinstance(e, Reasoning):
                delta = {"reasoning_content": e.text}
            elif isinstance(e, CallStart):
                delta = {"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                         "function": {"name": e.name, "arguments": ""}}]}
            else:
                delta = {"tool_calls": [{"index": e.index, "function": {"arguments": e.fragment}}]}
            parts.append(self._delta(delta, lp))
            lp = None
        if lp is not None:
            parts.append(self._delta({}, lp))
        return b"".join(parts)

    def passthrough(self, text: str, extra: dict[str, Any] | None, logprobs: dict[str, Any] | None) -> bytes:
        """An OpenAI-compatible upstream's delta fields and logprobs as it sent them, under our ids."""
        lp = logprobs if self.req.want_logprobs else None
        if self.req.kind != "chat":
            choice = {"index": self.req.prompt_index, "text": text, "logprobs": lp, "finish_reason": None}
            return f"data: {self.head},\"choices\":[{compact_json(choice)}]}}\n\n".encode()
        delta = {"content": text} if text else {}
        return self._delta({**delta, **(extra or {})}, lp)

    def _delta(self, delta: dict[str, Any], lp: dict[str, Any] | None) -> bytes:
        choice = {"index": self.req.prompt_index, "delta": delta, "logprobs": lp, "finish_reason": None}
        return f"data: {self.head},\"choices\":[{compact_json(choice)}]}}\n\n".encode()

    def usage(self, usage: dict[str, Any]) -> bytes:
        return f'data: {self.head},"choices":[],"usage":{compact_json(usage)}}}\n\n'.encode()


def named_events(events: list[dict[str, Any]]) -> bytes:
    """Events as the Responses and Anthropic Messages APIs stream them: an `event:` line naming the type, then
    its JSON."""
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e, ensure_ascii=False)}\n\n".encode() for e in events)


def with_usage(events: bytes, usage: dict[str, Any]) -> bytes:
    """`stream_options.continuous_usage_stats`: every chunk carries the usage so far (vLLM's shape)."""
    tail = b',"usage":' + compact_json(usage).encode() + b"}\n\n"
    return b"".join(e[:-1] + tail for e in events.split(b"\n\n") if e.startswith(b"data: {") and e.endswith(b"}"))


def error_event(message: str, type_: str = "upstream_error", code: str = "worker_failed") -> bytes:
    return f"data: {compact_json({'error': {'message': message, 'type': type_, 'param': None, 'code': code}})}\n\n".encode()


def usage_dict(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _token_str(tokenizer: Tokenizer | None, tid: int) -> str:
    return tokenizer.decode([tid], skip_special_tokens=False) if tokenizer else str(tid)


def render_logprobs(req: GenRequest, tokenizer: Tokenizer | None, lps: list[Logprob], text_offset: int) -> dict[str, Any]:
    if req.kind == "chat":
        content = []
        for lp in lps:
            tok = _token_str(tokenizer, lp.token_id)
            content.append({
                "token": tok, "logprob": lp.logprob, "bytes": list(tok.encode()),
                "top_logprobs": [{"token": (t := _token_str(tokenizer, tid)), "logprob": v, "bytes": list(t.encode())}
                                 for tid, v in lp.top],
            })
        return {"content": content}
    tokens, offsets = [], []
    off = text_offset
    for lp in lps:
        tok = _token_str(tokenizer, lp.token_id)
        tokens.append(tok)
        offsets.append(off)
        off += len(tok)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{_token_str(tokenizer, tid): v for tid, v in lp.top} for lp in lps], "text_offset": offsets}


def reply_message(req: GenRequest, text: str, token_ids: list[int] | None, finish: str,
                  extra: dict[str, Any] | None = None) -> tuple[dict[str, Any], str]:
    """The assistant message of a whole reply, and its finish reason (`tool_calls` when it called).
    `extra`: an upstream's own tool calls / reasoning, merged over the reply."""
    message: dict[str, Any]
    if extra:
        message = {"role": "assistant", "content": text or None, **extra}
        for tc in message.get("tool_calls", []):
            tc.pop("index", None)
        return message, finish
    if req.reply is None:
        return {"role": "assistant", "content": text}, finish
    parser = req.reply.parser()
    events = parser.feed(text, token_ids) + parser.close()
    content = "".join(e.text for e in events if isinstance(e, Content))
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    message = {"role": "assistant", "content": content or (None if parser.calls else "")}
    if reasoning:
        message["reasoning_content"] = reasoning
    if parser.calls:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in parser.calls]
        if finish == "stop":
            finish = "tool_calls"
    return message, finish


def full_response(reqs: list[GenRequest], model: str, results: list[dict[str, Any]], tokenizer: Tokenizer | None) -> dict[str, Any]:
    """Non-streaming body: results[i] = {text, finish_reason, logprobs, prompt, completion, cached}."""
    first = reqs[0]
    choices = []
    for req, r in zip(reqs, results, strict=True):
        lp = render_logprobs(req, tokenizer, r["logprobs"], 0) if req.want_logprobs else None
        if r.get("raw_logprobs") is not None and req.want_logprobs:
            lp = r["raw_logprobs"]
        if req.kind == "chat":
            message, finish = reply_message(req, r["text"], r.get("token_ids"), r["finish_reason"], r.get("extra"))
            choices.append({"index": req.prompt_index, "message": message, "logprobs": lp, "finish_reason": finish})
        else:
            choices.append({"index": req.prompt_index, "text": r["text"], "logprobs": lp,
                            "finish_reason": r["finish_reason"]})
    usage = usage_dict(sum(r["prompt"] for r in results), sum(r["completion"] for r in results),
                       sum(r["cached"] for r in results))
    return {"id": first.id, "object": "chat.completion" if first.kind == "chat" else "text_completion",
            "created": first.created, "model": model, "choices": choices, "usage": usage}
