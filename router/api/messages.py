"""`POST /v1/messages` and `/v1/messages/count_tokens`: Anthropic's Messages API on the chat serving path.

A Messages request is translated into a chat-completions body (so validation, templates, the tool-call
formats and grammars are the chat path's, for every model), and the reply is rendered as Anthropic content
blocks — `text`, `thinking`, `tool_use` — or, streaming, as its event sequence (`message_start`, `ping`,
`content_block_start` / `_delta` / `_stop`, `message_delta` with the stop reason and usage,
`message_stop`). Errors take Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`).

What it cannot honour is refused with a 400 naming it: image, document and search-result blocks, server
tools (web search, code execution, ...), extended thinking budgets, MCP servers, containers.
`cache_control` marks are accepted: every prompt prefix is cached without being asked.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from aiohttp import web

from router.api.chunks import Chunk, Logprob
from router.api.errors import APIError, bad_request
from router.api.protocol import GenRequest
from router.api.reply import Reasoning, ReplyEvent
from router.api.sse import ChoiceWriter, compact_json, named_events
from router.api.tool_calls import CallArgs, CallStart, Content

# The API's fields (its current SDK's, and the sampling fields earlier versions took, which clients still send),
# and splitfire's `priority`.
_FIELDS = {"model", "messages", "max_tokens", "system", "metadata", "stop_sequences", "stream", "temperature", "top_k",
           "top_p", "tools", "tool_choice", "thinking", "service_tier", "container", "mcp_servers",
           "context_management", "cache_control", "diagnostics", "inference_geo", "output_config", "speed",
           "user_profile_id", "workspace_id", "priority"}
_REFUSED = {
    "container": "containers (code execution) are not supported",
    "mcp_servers": "MCP servers are not supported; run the tools in your client and send tool_result blocks",
    "context_management": "'context_management' is not supported",
    "diagnostics": "'diagnostics' (prompt-cache miss reasons) is not supported",
    "inference_geo": "'inference_geo' is not supported: the fleet serves where it runs",
    "workspace_id": "workspaces are not served here: the API key's tenant scopes a request",
}
_COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking", "mcp_servers", "cache_control",
                 "output_config", "output_format", "speed", "user_profile_id", "workspace_id"}

# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}


def error_response(e: APIError) -> web.Response:
    """An error in Anthropic's shape. The fleet being full (503) is Anthropic's 529 `overloaded_error`,
    which its SDKs retry; the headers (Retry-After) stay."""
    status = 529 if e.status == 503 else e.status
    kind = _ERROR_TYPES.get(status, "api_error")
    body = {"type": "error", "error": {"type": kind, "message": e.message}}
    return web.Response(status=status, text=json.dumps(body), content_type="application/json", headers=e.headers)


def _text_blocks(value: Any, where: str) -> str:
    """A string, or a list of text blocks, as one string."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_request(f"{where} must be a string or a list of text blocks", param=where)
    out = []
    for i, b in enumerate(value):
        if not (isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)):
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise bad_request(f"{where}[{i}]: {kind!r} blocks are not supported here (text only)", param=f"{where}[{i}]")
        out.append(b["text"])
    return "".join(out)


def _unsupported(kind: Any, where: str) -> APIError:
    if kind in ("image", "document", "search_result", "container_upload"):
        return bad_request(f"{where}: {kind} blocks are not supported (this model reads text)", param=where)
    if kind in ("server_tool_use", "web_search_tool_result", "web_fetch_tool_result", "code_execution_tool_result",
                "mcp_tool_use", "mcp_tool_result"):
        return bad_request(f"{where}: {kind} blocks belong to server tools, which are not supported", param=where)
    return bad_request(f"{where}: unknown content block type {kind!r}", param=where)


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text_blocks(system, "system")})
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("'messages' must be a non-empty list", param="messages")
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object", param=where)
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise bad_request(f"{where}.role must be 'user' or 'assistant'", param=f"{where}.role")
        if set(m) - {"role", "content"}:
            raise bad_request(f"{where}: unknown field(s) {sorted(set(m) - {'role', 'content'})}", param=where)
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad_request(f"{where}.content must be a string or a list of content blocks", param=f"{where}.content")
        text: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, b in enumerate(content):
            bw = f"{where}.content[{j}]"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text" and isinstance(b.get("text"), str):
                text.append(b["text"])
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # earlier thinking is not re-sent to the model (as chat templates drop it)
            elif kind == "tool_use" and role == "assistant":
                if not (isinstance(b.get("id"), str) and isinstance(b.get("name"), str)
                        and isinstance(b.get("input"), dict)):
                    raise bad_request(f"{bw} (tool_use) needs a string id and name and an object input", param=bw)
                calls.append({"id": b["id"], "type": "function",
                              "function": {"name": b["name"], "arguments": json.dumps(b["input"], ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":
                if not isinstance(b.get("tool_use_id"), str):
                    raise bad_request(f"{bw}.tool_use_id must be a string", param=f"{bw}.tool_use_id")
                result = _text_blocks(b.get("content", ""), f"{bw}.content")
                if b.get("is_error"):
                    result = f"Error: {result}"
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": result})
            elif kind in ("text", "tool_use", "tool_result", "thinking", "redacted_thinking"):
                raise bad_request(f"{bw}: a {kind} block is not allowed in a {role} message", param=bw)
            else:
                raise _unsupported(kind, bw)
        if role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif text:
            out.append({"role": "user", "content": "".join(text)})
    return out


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list", param="tools")
    out = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad_request(f"{where} must be an object", param=where)
        if t.get("type") not in (None, "custom"):
            raise bad_request(f"{where}: server tool {t.get('type')!r} is not supported; define it as a custom tool "
                              "(name, description, input_schema) and run it in your client", param=where)
        if not isinstance(t.get("name"), str) or not isinstance(t.get("input_schema"), dict):
            raise bad_request(f"{where} needs a string 'name' and an object 'input_schema'", param=where)
        fn = {"name": t["name"], "parameters": t["input_schema"]}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(body: dict[str, Any], chat: dict[str, Any]) -> None:
    tc = body.get("tool_choice")
    if tc is None:
        return
    if not isinstance(tc, dict) or tc.get("type") not in ("auto", "any", "tool", "none"):
        raise bad_request("'tool_choice' must be {'type': 'auto' | 'any' | 'tool' | 'none'}", param="tool_choice")
    kind = tc["type"]
    if kind == "tool":
        if not isinstance(tc.get("name"), str):
            raise bad_request("'tool_choice' of type 'tool' needs a 'name'", param="tool_choice")
        chat["tool_choice"] = {"type": "function", "function": {"name": tc["name"]}}
    else:
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    if tc.get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False


def _check(body: Any, fields: set[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    for name, value in body.items():
        if name not in fields:
            raise bad_request(f"{name}: Extra inputs are not permitted", param=name)
        if name in _REFUSED and value not in (None, [], {}):
            raise bad_request(_REFUSED[name], param=name)
    thinking = body.get("thinking")
    if thinking is not None and not (isinstance(thinking, dict) and thinking.get("type") in ("disabled", "adaptive")):
        raise bad_request("thinking budgets are not supported: the model thinks as its chat template says (its "
                          "thinking is returned in thinking blocks); send thinking {'type': 'adaptive'} or "
                          "{'type': 'disabled'}, or omit it", param="thinking")
    if body.get("speed") not in (None, "standard"):
        raise bad_request("only speed 'standard' is served", param="speed")
    return body


def _output_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """`output_config.format` (structured output: a JSON schema) as the chat route's response_format."""
    config = body.get("output_config")
    if config is None:
        return None
    if not isinstance(config, dict) or set(config) - {"effort", "format"}:
        raise bad_request("'output_config' may hold 'format' (and 'effort')", param="output_config")
    if config.get("effort") is not None:
        raise bad_request("'output_config.effort' is not supported: the model reasons as its chat template says",
                          param="output_config.effort")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not (isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict)):
        raise bad_request("'output_config.format' must be {'type': 'json_schema', 'schema': {...}}",
                          param="output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}


def to_chat(body: Any) -> dict[str, Any]:
    """The chat-completions body that asks for what a Messages request asks."""
    body = _check(body, _FIELDS)
    if body.get("max_tokens") is None:
        raise bad_request("max_tokens: Field required", param="max_tokens")
    if body.get("service_tier") not in (None, "auto", "standard_only"):
        raise bad_request("only service_tier 'auto' or 'standard_only' is served", param="service_tier")
    chat: dict[str, Any] = {k: body[k] for k in ("model", "max_tokens", "temperature", "top_p", "top_k", "stream",
                                                  "priority") if body.get(k) is not None}
    chat["messages"] = _messages(body)
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise bad_request("'stop_sequences' must be a list of non-empty strings", param="stop_sequences")
        if stops:
            chat["stop"] = stops
    fmt = _output_format(body)
    if fmt is not None:
        chat["response_format"] = fmt
    if isinstance(body.get("user_profile_id"), str):
        chat["user"] = body["user_profile_id"]
    meta = body.get("metadata")
    if meta is not None:
        if not isinstance(meta, dict) or set(meta) - {"user_id"}:
            raise bad_request("'metadata' may hold only 'user_id'", param="metadata")
        user = meta.get("user_id")
        if user is not None:
            if not isinstance(user, str):
                raise bad_request("'metadata.user_id' must be a string", param="metadata.user_id")
            chat["user"] = user
            chat["prompt_cache_key"] = user  # the session-affinity key: a user's turns go where their KV is
    tools = _tools(body)
    if tools:
        chat["tools"] = tools
    _tool_choice(body, chat)
    if "tool_choice" in chat and not tools and chat["tool_choice"] != "none":
        raise bad_request("'tool_choice' needs 'tools'", param="tool_choice")
    return chat


def count_tokens_chat(body: Any) -> dict[str, Any]:
    """The chat body whose prompt `count_tokens` counts (one output token asked, so it validates)."""
    body = _check(body, _COUNT_FIELDS)
    if body.get("output_format") is not None:  # (the field's older place)
        body = {**body, "output_config": {"format": body["output_format"]}}
    return to_chat({**{k: v for k, v in body.items() if k not in ("thinking", "output_format")}, "max_tokens": 1})


def _new_id() -> str:
    return f"msg_{secrets.token_hex(12)}"


class MessageAssembler:
    """Builds the message's content blocks from the reply's events, and the stream events for them."""

    def __init__(self, req: GenRequest, body: dict[str, Any]):
        self.id = _new_id()
        self.model = req.model
        self.prompt_tokens = len(req.prompt_token_ids)
        self.stops = body.get("stop_sequences") or []
        self.content: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the text or thinking block receiving text
        self._calls: dict[int, tuple[dict[str, Any], list[str]]] = {}  # call index -> (tool_use block, json parts)
        self._open_call: dict[str, Any] | None = None  # the tool_use block receiving argument fragments

    def message(self, stop_reason: str | None, stop_sequence: str | None, usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": self.content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    def start(self) -> list[dict[str, Any]]:
        usage = {"input_tokens": self.prompt_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0,
                 "cache_read_input_tokens": 0}
        return [{"type": "message_start", "message": {**self.message(None, None, usage), "content": []}},
                {"type": "ping"}]

    def _close_open(self) -> list[dict[str, Any]]:
        """Close the block in progress (text, thinking or tool_use): blocks never interleave."""
        block = self._open or self._open_call
        self._open = self._open_call = None
        if block is None:
            return []
        return [{"type": "content_block_stop", "index": self.content.index(block)}]

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        field = "text" if kind == "text" else "thinking"
        if self._open is None or self._open["type"] != kind:
            events += self._close_open()
            block: dict[str, Any] = {"type": "text", "text": ""} if kind == "text" else \
                {"type": "thinking", "thinking": "", "signature": ""}
            self.content.append(block)
            self._open = block
            events.append({"type": "content_block_start", "index": len(self.content) - 1, "content_block": dict(block)})
        block = self._open
        block[field] += text
        delta = {"type": "text_delta", "text": text} if kind == "text" else {"type": "thinking_delta", "thinking": text}
        return [*events, {"type": "content_block_delta", "index": self.content.index(block), "delta": delta}]

    def feed(self, events: list[Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, Content):
                if e.text:
                    out += self._text("text", e.text)
            elif isinstance(e, Reasoning):
                if e.text:
                    out += self._text("thinking", e.text)
            elif isinstance(e, CallStart):
                out += self._close_open()
                block = {"type": "tool_use", "id": e.id, "name": e.name, "input": {}}
                self.content.append(block)
                self._calls[e.index] = (block, [])
                self._open_call = block
                out.append({"type": "content_block_start", "index": len(self.content) - 1,
                            "content_block": {"type": "tool_use", "id": e.id, "name": e.name, "input": {}}})
            elif isinstance(e, CallArgs):
                block, parts = self._calls[e.index]
                parts.append(e.fragment)
                out.append({"type": "content_block_delta", "index": self.content.index(block),
                            "delta": {"type": "input_json_delta", "partial_json": e.fragment}})
        return out

    def finish(self, finish_reason: str, stop: str | int | None, prompt: int, completion: int, cached: int
               ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The closing events and the final message."""
        events = self._close_open()
        for block, parts in self._calls.values():
            raw = "".join(parts)
            try:
                block["input"] = json.loads(raw) if raw.strip() else {}
            except json.JSONDecodeError:
                block["input"] = {"_raw": raw}  # (a model without a tool grammar may write broken JSON)
        stop_sequence = stop if isinstance(stop, str) and stop in self.stops else None
        if self._calls:
            reason = "tool_use"
        elif finish_reason == "length":
            reason = "max_tokens"
        else:
            reason = "stop_sequence" if stop_sequence is not None else "end_turn"
        # Anthropic's input_tokens are those not read from a cache (the three add up to the prompt).
        usage = {"input_tokens": prompt - cached, "output_tokens": completion, "cache_creation_input_tokens": 0,
                 "cache_read_input_tokens": cached}
        events += [{"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
                    "usage": usage},
                   {"type": "message_stop"}]
        return events, self.message(reason, stop_sequence, usage)



class MessagesWriter:
    """The one choice of a Messages stream, as Anthropic's events (`ChoiceWriter`). Plain text inside an open
    text block — nearly every token — takes a fast path (`text`): the event's bytes around the text's JSON,
    as the chat writer does it; the assembler's `feed` stays the reference (tests/test_agent_api.py holds the
    two to the same message)."""

    def __init__(self, asm: MessageAssembler):
        self.asm = asm
        self._block: dict[str, Any] | None = None  # the text block `_pre` is for
        self._pre = b""

    def role(self) -> bytes:
        return named_events(self.asm.start())

    def text(self, text: str, logprobs: list[Logprob] | None = None) -> bytes:
        if not text:
            return b""
        block = self.asm._open
        if block is None or block["type"] != "text":
            return self.events([Content(text)])
        if block is not self._block:
            self._block = block
            index = self.asm.content.index(block)
            self._pre = ('event: content_block_delta\ndata: {"type":"content_block_delta","index":' + str(index)
                         + ',"delta":{"type":"text_delta","text":').encode()
        # (the block's text is not kept: a stream's final message is never sent whole)
        return self._pre + compact_json(text).encode() + b"}}\n\n"

    def events(self, events: list[ReplyEvent], logprobs: list[Logprob] | None = None) -> bytes:
        return named_events(self.asm.feed(events))

    def passthrough(self, text: str, extra: dict[str, Any] | None, logprobs: dict[str, Any] | None) -> bytes:
        return self.text(text)  # (never reached: /v1/messages is refused in front of upstreams)

    def finish(self, reason: str, last: Chunk) -> bytes:
        events, _ = self.asm.finish(reason, last.stop_reason, last.prompt_tokens, last.completion_tokens,
                                    last.cached_tokens)
        return named_events(events)

    def usage(self, usage: dict[str, Any]) -> bytes:
        return b""  # usage is in message_delta


class MessagesFormat:
    """`/v1/messages` on the chat serving path (`sse.ReplyFormat`): one choice, rendered as content blocks."""

    done = b""  # (a Messages stream ends with message_stop)

    def __init__(self, req: GenRequest, body: dict[str, Any]):
        self.asm = MessageAssembler(req, body)

    def writers(self, reqs: list[GenRequest]) -> list[ChoiceWriter]:
        return [MessagesWriter(self.asm)]

    def opening(self, reqs: list[GenRequest], writers: list[ChoiceWriter], early: bool) -> bytes:
        return writers[0].role()

    def error(self, message: str, type_: str, code: str) -> bytes:
        kind = "overloaded_error" if code in ("no_capacity", "no_healthy_workers") else "api_error"
        return named_events([{"type": "error", "error": {"type": kind, "message": message}}])

    def body(self, reqs: list[GenRequest], results: list[dict[str, Any]]) -> dict[str, Any]:
        r, req = results[0], reqs[0]
        if req.reply is None:
            events: list[ReplyEvent] = [Content(r["text"])] if r["text"] else []
        else:
            parser = req.reply.parser()
            events = parser.feed(r["text"], r.get("token_ids")) + parser.close()
        self.asm.feed(events)
        _, final = self.asm.finish(r["finish_reason"], r.get("stop_reason"), r["prompt"], r["completion"], r["cached"])
        return final
