"""`POST /v1/responses`, the stateless subset of OpenAI's Responses API.

A Responses request is translated into a chat-completions body (so validation, templates, tool
grammars and structured output are the chat path's), and the reply is rendered as Responses
output items — a `message` with `output_text`, `function_call` items, a `reasoning` item — or,
streaming, as the official event sequence (`response.created` ... `response.completed`).
Nothing is stored: `previous_response_id`, `conversation` and `store: true` are refused.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from router.api.chunks import Chunk, Logprob
from router.api.errors import bad_request
from router.api.protocol import GenRequest
from router.api.reply import Reasoning, ReplyEvent
from router.api.sse import ChoiceWriter, named_events
from router.api.tool_calls import CallArgs, CallStart, Content

_PASS = ("model", "temperature", "top_p", "parallel_tool_calls", "user", "safety_identifier", "prompt_cache_key",
         "stream")
_DEFAULT_ONLY = {
    "store": (lambda v: v in (None, False), "responses are not stored here; send store=false"),
    "previous_response_id": (lambda v: v is None, "'previous_response_id' needs stored responses, which are not "
                                                   "kept here; send the conversation's items in 'input'"),
    "conversation": (lambda v: v is None, "conversations are not stored here; send the items in 'input'"),
    "background": (lambda v: v in (None, False), "background responses are not supported"),
    "include": (lambda v: v in (None, []), "'include' is not supported"),
    "metadata": (lambda v: v in (None, {}), "'metadata' is for stored responses, which are not kept here"),
    "truncation": (lambda v: v in (None, "disabled"), "only truncation 'disabled' is supported"),
    "service_tier": (lambda v: v in (None, "auto", "default"), "only service_tier 'auto' or 'default' is served"),
    "reasoning": (lambda v: v is None or (isinstance(v, dict) and v.get("effort") is None and v.get("summary") is None),
                  "'reasoning' options are not supported; the model reasons as its chat template says"),
    "stream_options": (lambda v: v in (None, {}), "'stream_options' is not supported on /v1/responses"),
    "max_tool_calls": (lambda v: v is None, "'max_tool_calls' is not supported"),
    "top_logprobs": (lambda v: v in (None, 0), "'top_logprobs' is not supported on /v1/responses"),
    "prompt": (lambda v: v is None, "prompt templates ('prompt') are not supported"),
}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text")
                    and isinstance(part.get("text"), str)):
                raise bad_request(f"{where}[{i}] must be an input_text or output_text part (this model reads text "
                                  "only)", param=where)
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"{where} must be a string or a list of text parts", param=where)


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("'instructions' must be a string", param="instructions")
        out.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return [*out, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("'input' must be a string or a non-empty list of items", param="input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role must be user, system, developer or assistant", param=f"{where}.role")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
            if not (isinstance(call_id, str) and isinstance(name, str) and isinstance(args, str)):
                raise bad_request(f"{where} (function_call) needs string call_id, name and arguments", param=where)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise bad_request(f"{where}.call_id must be a string", param=f"{where}.call_id")
            out.append({"role": "tool", "tool_call_id": call_id, "content": _text_of(output, f"{where}.output")})
        elif kind == "reasoning":
            continue  # earlier reasoning is not re-sent to the model (as chat templates drop it)
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported (message, function_call, "
                              "function_call_output)", param=where)
    return out


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list", param="tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise bad_request(f"tools[{i}]: only function tools are supported", param=f"tools[{i}]")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(body: dict[str, Any]) -> Any:
    tc = body.get("tool_choice")
    if isinstance(tc, dict):
        if tc.get("type") != "function" or not isinstance(tc.get("name"), str):
            raise bad_request("'tool_choice' must be auto, none, required or {'type': 'function', 'name': ...}",
                              param="tool_choice")
        return {"type": "function", "function": {"name": tc["name"]}}
    return tc


def _response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise bad_request("'text' must be an object with 'format'", param="text")
    if text.get("verbosity") is not None:
        raise bad_request("'text.verbosity' is not supported", param="text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("'text.format' must be an object", param="text.format")
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return fmt  # text / json_object, or an unknown type the chat validation refuses by name


def to_chat(body: Any) -> dict[str, Any]:
    """The chat-completions body that asks for the same thing."""
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    known = set(_PASS) | set(_DEFAULT_ONLY) | {"input", "instructions", "tools", "tool_choice", "text",
                                               "max_output_tokens"}
    for name, value in body.items():
        if name not in known:
            raise bad_request(f"Unrecognized request argument supplied: {name}", param=name)
        rule = _DEFAULT_ONLY.get(name)
        if rule is not None and not rule[0](value):
            raise bad_request(rule[1], param=name)
    chat: dict[str, Any] = {k: body[k] for k in _PASS if body.get(k) is not None}
    chat["messages"] = _messages(body)
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for key, value in (("tools", _tools(body)), ("tool_choice", _tool_choice(body)),
                       ("response_format", _response_format(body))):
        if value is not None:
            chat[key] = value
    return chat


class ResponseAssembler:
    """Builds the response's output items from the reply's events, and the stream events for them."""

    def __init__(self, rid: str, model: str, body: dict[str, Any]):
        self.rid = rid
        self.body = body
        self.model = model
        self.created = int(time.time())
        self.output: list[dict[str, Any]] = []
        self.seq = 0
        self._open: dict[str, Any] | None = None  # the message or reasoning item receiving text
        self._calls: dict[int, dict[str, Any]] = {}  # call index -> function_call item

    def _event(self, type_: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def response(self, status: str, usage: dict[str, Any] | None = None, reason: str | None = None) -> dict[str, Any]:
        b = self.body
        fmt = (b.get("text") or {}).get("format") or {"type": "text"}
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": status, "model": self.model,
                "output": self.output, "usage": usage, "error": None,
                "incomplete_details": {"reason": reason} if reason else None,
                "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
                "temperature": b.get("temperature", 1.0), "top_p": b.get("top_p", 1.0),
                "tools": b.get("tools") or [], "tool_choice": b.get("tool_choice") or "auto",
                "parallel_tool_calls": b.get("parallel_tool_calls", True), "text": {"format": fmt},
                "previous_response_id": None, "store": False, "truncation": "disabled", "metadata": {},
                "reasoning": {"effort": None, "summary": None}, "user": b.get("user")}

    def start(self) -> list[dict[str, Any]]:
        r = self.response("in_progress")
        return [self._event("response.created", response=r), self._event("response.in_progress", response=r)]

    def _close_open(self) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        i = self.output.index(item)
        if item["type"] == "reasoning":
            part = item["content"][0]
            events = [self._event("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0,
                                  text=part["text"])]
        else:
            part = item["content"][0]
            events = [self._event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                                  text=part["text"], logprobs=[]),
                      self._event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                                  part=part)]
        item["status"] = "completed"
        return [*events, self._event("response.output_item.done", output_index=i, item=item)]

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close_open()
            item: dict[str, Any]
            if kind == "message":
                item = {"type": "message", "id": _new_id("msg"), "status": "in_progress", "role": "assistant",
                        "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
            else:
                item = {"type": "reasoning", "id": _new_id("rs"), "status": "in_progress", "summary": [],
                        "content": [{"type": "reasoning_text", "text": ""}]}
            self.output.append(item)
            self._open = item
            i = len(self.output) - 1
            events.append(self._event("response.output_item.added", output_index=i, item=item))
            if kind == "message":
                events.append(self._event("response.content_part.added", item_id=item["id"], output_index=i,
                                          content_index=0, part=item["content"][0]))
        item = self._open
        assert item is not None
        item["content"][0]["text"] += text
        i = self.output.index(item)
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        return [*events, self._event(name, item_id=item["id"], output_index=i, content_index=0, delta=text, **extra)]

    def feed(self, events: list[Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, Content):
                if e.text:
                    out += self._text("message", e.text)
            elif isinstance(e, Reasoning):
                if e.text:
                    out += self._text("reasoning", e.text)
            elif isinstance(e, CallStart):
                out += self._close_open()
                item = {"type": "function_call", "id": _new_id("fc"), "call_id": e.id, "name": e.name,
                        "arguments": "", "status": "in_progress"}
                self.output.append(item)
                self._calls[e.index] = item
                out.append(self._event("response.output_item.added", output_index=len(self.output) - 1, item=item))
            elif isinstance(e, CallArgs):
                item = self._calls[e.index]
                item["arguments"] += e.fragment
                out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                       output_index=self.output.index(item), delta=e.fragment))
        return out

    def finish(self, finish_reason: str, prompt: int, completion: int, cached: int
               ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The closing events and the final response object."""
        events = self._close_open()
        for item in self._calls.values():
            i = self.output.index(item)
            item["status"] = "completed"
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                      arguments=item["arguments"]))
            events.append(self._event("response.output_item.done", output_index=i, item=item))
        usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                 "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": prompt + completion}
        incomplete = finish_reason == "length"
        final = self.response("incomplete" if incomplete else "completed", usage,
                              "max_output_tokens" if incomplete else None)
        events.append(self._event("response.incomplete" if incomplete else "response.completed", response=final))
        return events, final



class ResponsesWriter:
    """The one choice of a Responses stream, as the Responses API's events (`ChoiceWriter`)."""

    def __init__(self, asm: ResponseAssembler):
        self.asm = asm

    def role(self) -> bytes:
        return named_events(self.asm.start())

    def text(self, text: str, logprobs: list[Logprob] | None = None) -> bytes:
        return self.events([Content(text)] if text else [])

    def events(self, events: list[ReplyEvent], logprobs: list[Logprob] | None = None) -> bytes:
        return named_events(self.asm.feed(events))

    def passthrough(self, text: str, extra: dict[str, Any] | None, logprobs: dict[str, Any] | None) -> bytes:
        return self.text(text)  # (never reached: /v1/responses is refused in front of upstreams)

    def finish(self, reason: str, last: Chunk) -> bytes:
        events, _ = self.asm.finish(reason, last.prompt_tokens, last.completion_tokens, last.cached_tokens)
        return named_events(events)

    def usage(self, usage: dict[str, Any]) -> bytes:
        return b""  # usage is in response.completed


class ResponsesFormat:
    """`/v1/responses` on the chat serving path (`sse.ReplyFormat`): one choice, rendered as output items."""

    done = b""  # (a Responses stream ends with response.completed, no [DONE])

    def __init__(self, req: GenRequest, body: dict[str, Any]):
        self.asm = ResponseAssembler(f"resp_{req.id.removeprefix('chatcmpl-')}", req.model, body)

    def writers(self, reqs: list[GenRequest]) -> list[ChoiceWriter]:
        return [ResponsesWriter(self.asm)]

    def opening(self, reqs: list[GenRequest], writers: list[ChoiceWriter], early: bool) -> bytes:
        return writers[0].role()

    def error(self, message: str, type_: str, code: str) -> bytes:
        return named_events([{"type": "error", "sequence_number": self.asm.seq, "code": code, "message": message,
                            "param": None}])

    def body(self, reqs: list[GenRequest], results: list[dict[str, Any]]) -> dict[str, Any]:
        r, req = results[0], reqs[0]
        if req.reply is None:
            events: list[ReplyEvent] = [Content(r["text"])] if r["text"] else []
        else:
            parser = req.reply.parser()
            events = parser.feed(r["text"], r.get("token_ids")) + parser.close()
        self.asm.feed(events)
        _, final = self.asm.finish(r["finish_reason"], r["prompt"], r["completion"], r["cached"])
        return final
