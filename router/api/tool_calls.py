"""Tool calls: the OpenAI `tools` / `tool_choice` fields, the grammar that makes a model write a
call in its own format, and reading calls back out of its output, whole or as it streams.

Formats (one per model family, found in the chat template):
- `hermes`: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, repeated (Qwen2.5, Qwen3, Hermes).
- `llama3_json`: the whole reply is `{"name": ..., "parameters": {...}}` (Llama 3.1+ custom tools).
- `mistral`: the `[TOOL_CALLS]` token, then `[{"name": ..., "arguments": {...}}, ...]`.
- `generic`: for models whose chat template has none (SmolLM2, the default model): the reply is a JSON
  list of calls, `[{"name": ..., "arguments": {...}}, ...]`, taught in a system message that lists the
  tools (`protocol.tools_as_text`, llama.cpp's generic approach). Under `auto` the reply is constrained
  by a union grammar, *free text | tool calls*: free text is any text that does not open with `[` (so
  prose is unchanged), and once the reply opens with `[` the calls' JSON is grammar-constrained from
  its first token; the list's `]` ends the reply. `required` / named: the calls only. (Hermes-style
  `<tool_call>` blocks were tried first: a block can always be followed by another, and SmolLM2 kept
  adding calls until max_tokens; a list closes.)

A call is `{"name": "...", "arguments": <object>}` in every format (Llama says `parameters`);
under a grammar the keys come in that order, so the name is known first and the arguments
stream out as they are generated (OpenAI's delta shape). A call whose keys come in another
order (possible with `auto`) is emitted whole when it closes.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Any

from common import grammar
from router.api.errors import bad_request

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # none | auto | required | named
    tools: tuple[Tool, ...]  # those the model may call (one for `named`)
    parallel: bool


def parse_tools(body: dict[str, Any]) -> list[Tool] | None:
    raw = body.get("tools")
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise bad_request("'tools' must be a list", param="tools")
    tools: list[Tool] = []
    for i, t in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise bad_request(f"'{where}' must be {{'type': 'function', 'function': {{...}}}}", param=where)
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request(f"'{where}.function.name' must be 1-64 letters, digits, '_' or '-'",
                              param=f"{where}.function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad_request(f"'{where}.function.parameters' must be a JSON schema object",
                              param=f"{where}.function.parameters")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise bad_request(f"'{where}.function.description' must be a string", param=f"{where}.function.description")
        try:
            grammar.json_schema(params, f"{where}.function.parameters")
        except grammar.GrammarError as e:
            raise bad_request(str(e), param=e.param) from e
        if any(x.name == name for x in tools):
            raise bad_request(f"'{where}.function.name' {name!r} is defined twice", param=f"{where}.function.name")
        tools.append(Tool(name, params))
    return tools


def parse_tool_choice(body: dict[str, Any], tools: list[Tool] | None) -> ToolChoice:
    raw = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    if not tools:
        if raw not in (None, "none"):
            raise bad_request("'tool_choice' needs 'tools'", param="tool_choice")
        return ToolChoice("none", (), parallel)
    if raw is None:
        raw = "auto"
    if raw in ("none", "auto", "required"):
        return ToolChoice(raw, tuple(tools), parallel)
    if isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("function"), dict):
        name = raw["function"].get("name")
        tool = next((t for t in tools if t.name == name), None)
        if tool is None:
            raise bad_request(f"'tool_choice.function.name' {name!r} is not one of the tools",
                              param="tool_choice.function.name")
        return ToolChoice("named", (tool,), False)
    raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                      "{'name': ...}}", param="tool_choice")


def call_schema(tools: tuple[Tool, ...], args_key: str = "arguments") -> dict[str, Any]:
    """One call to any of `tools`, name first: {"name": <one of them>, args_key: <its parameters>}."""
    options = [{"type": "object", "properties": {"name": {"const": t.name}, args_key: t.parameters},
                "required": ["name", args_key], "additionalProperties": False} for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI returns it


# -- output events (what the stream writer renders) ------------------------------------------


@dataclass
class Content:
    text: str


@dataclass
class CallStart:
    index: int
    id: str
    name: str


@dataclass
class CallArgs:
    index: int
    fragment: str


Event = Content | CallStart | CallArgs


class _CallScanner:
    """Reads one call object `{"name": ..., "arguments": ...}` a character at a time.

    Emits CallStart when the name is known and CallArgs for the arguments' characters as they
    arrive; `done` once the object closes. Keys in another order are buffered and emitted at
    the close. A string value is tracked so braces inside it do not count."""

    def __init__(self, index: int, call_id: str, args_keys: tuple[str, ...]):
        self.index, self.id, self.args_keys = index, call_id, args_keys
        self.raw: list[str] = []
        self.depth = 0
        self.in_string = self.escape = False
        self.key: str | None = None  # the top-level key whose value is being read
        self.string_start = -1
        self.last_string = ""
        self.expect_key = True
        self.name: str | None = None
        self.started = False
        self.args_start = -1  # offset in raw of the arguments value
        self.args_sent = 0  # chars of the arguments value already emitted
        self.args_end = -1
        self.done = False

    def feed(self, ch: str, out: list[Event]) -> None:
        self.raw.append(ch)
        pos = len(self.raw) - 1
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
                if self.depth == 1:
                    self.last_string = json.loads("".join(self.raw[self.string_start : pos + 1]))
                    if self.expect_key:
                        self.key = self.last_string
                    elif self.key == "name":
                        self.name = self.last_string
                        self._start(out)
        elif ch == '"':
            self.in_string = True
            if self.depth == 1:
                self.string_start = pos
        elif ch in "{[":
            self.depth += 1
            if self.depth == 2 and self.key in self.args_keys and self.args_start < 0:
                self.args_start = pos
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 1 and self.key in self.args_keys and self.args_start >= 0 and self.args_end < 0:
                self.args_end = pos + 1
            if self.depth == 0:
                self.done = True
        elif self.depth == 1 and ch == ":":
            self.expect_key = False
        elif self.depth == 1 and ch == ",":
            self.expect_key = True
        if self.started and self.args_start >= 0:
            end = self.args_end if self.args_end >= 0 else len(self.raw)
            if end > self.args_start + self.args_sent:
                out.append(CallArgs(self.index, "".join(self.raw[self.args_start + self.args_sent : end])))
                self.args_sent = end - self.args_start

    def _start(self, out: list[Event]) -> None:
        if not self.started and self.name is not None:
            self.started = True
            out.append(CallStart(self.index, self.id, self.name))

    def finish(self, out: list[Event]) -> bool:
        """At the object's close (or the output's end): True when this was a well-formed call."""
        text = "".join(self.raw).strip()
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            return False
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return False
        args: Any = next((obj[k] for k in self.args_keys if k in obj), {})
        if not self.started:  # keys out of order (or no arguments): everything now
            self.name = obj["name"]
            self._start(out)
            out.append(CallArgs(self.index, json.dumps(args, ensure_ascii=False)))
        elif self.args_start < 0:
            out.append(CallArgs(self.index, json.dumps(args, ensure_ascii=False)))
        return True


def _call_id(style: str) -> str:
    if style == "mistral":  # Mistral's template insists on 9 alphanumerics
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return f"call_{secrets.token_hex(12)}"


@dataclass
class ToolFormat:
    name: str
    open: str  # text that starts the call region ("" = the reply itself, if it starts with `first`)
    close: str  # text that ends one call ("" = calls run to the end)
    first: str = ""  # with open == "": the character a call region starts with
    array: bool = False  # calls are a JSON array
    args_keys: tuple[str, ...] = ("arguments",)
    open_token: int | None = None  # a special token that opens the region (dropped from the text)

    def grammar(self, choice: ToolChoice) -> str:
        """Lark grammar for `required` / named choices: one call (or several, if parallel) to the tools."""
        call = grammar.lark_json(call_schema(choice.tools, self.args_keys[0]))
        if self.array:
            items = f'{call} (", " {call})*' if choice.parallel else call
            head = f"<[{self.open_token}]> " if self.open_token is not None else ""
            return grammar.lark(f'start: {head}"[" {items} "]"', "tools")
        if self.name == "hermes":
            block = f'"<tool_call>\\n" {call} "\\n</tool_call>"'
            body = f'{block} ("\\n" {block})*' if choice.parallel else block
            return grammar.lark(f"start: {body}", "tools")
        return grammar.lark(f"start: {call}", "tools")  # llama3_json: one call

    def auto_grammar(self, choice: ToolChoice) -> str:
        """`auto` in the generic format: free text (anything not opening with `[`) or a list of calls."""
        call = grammar.lark_json(call_schema(choice.tools, self.args_keys[0]))
        items = f'{call} (", " {call})*' if choice.parallel else call
        return grammar.lark(f'start: TEXT | calls\ncalls: "[" {items} "]"\n'
                            "TEXT: /(.|\\n)*/ & ~/[ \\t\\n]*\\[(.|\\n)*/", "tools")

    def extractor(self) -> ToolCallExtractor:
        return ToolCallExtractor(self)


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>")
GENERIC = ToolFormat("generic", "", "", first="[", array=True)
LLAMA3_JSON = ToolFormat("llama3_json", "", "", first="{", args_keys=("parameters", "arguments"))
JSON_ARRAY = ToolFormat("json", "", "", first="[", array=True)


def mistral_format(tool_calls_token: int) -> ToolFormat:
    return ToolFormat("mistral", "", "", first="[", array=True, open_token=tool_calls_token)


def detect_format(chat_template: str | None, token_to_id) -> ToolFormat | None:
    """The model's own tool-call format, read off its chat template; None if it has none (the DeepSeek
    and Kimi families' marked formats: `marked_calls.detect_marked`)."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return HERMES
    if "[TOOL_CALLS]" in chat_template and token_to_id("[TOOL_CALLS]") is not None:
        return mistral_format(token_to_id("[TOOL_CALLS]"))
    if "<|python_tag|>" in chat_template or ('"parameters"' in chat_template and "ipython" in chat_template):
        return LLAMA3_JSON
    return None


def template_supports_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template  # type: ignore[operator]


class ToolCallExtractor:
    """Splits a reply into content and tool calls, fed as it streams (`feed`) and closed at the end.

    Whitespace is held back until more content follows: between and around calls it is layout,
    not an answer, and is dropped when the reply turns out to be calls."""

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self.calls: list[ToolCall] = []
        self._marker = ""  # hermes: text that may be the start of `<tool_call>`
        self._space = ""  # whitespace held back
        self._scanner: _CallScanner | None = None
        self._in_array = False  # inside the `[...]` of an array format
        self._started = False  # the reply has begun (for formats decided by its first character)
        self._after_call = ""  # hermes: text between a call object and `</tool_call>`

    def feed(self, text: str, token_ids: list[int] | None = None) -> list[Event]:
        out: list[Event] = []
        fmt = self.fmt
        if fmt.open_token is not None and token_ids and not self._started and token_ids[0] == fmt.open_token:
            self._started = True
            self._in_array = True  # the open token comes as a token, not text
        for ch in text:
            self._char(ch, out)
        return coalesce(out)

    def _content(self, text: str, out: list[Event]) -> None:
        if text.isspace():
            self._space += text
            return
        out.append(Content(self._space + text))
        self._space = ""

    def _char(self, ch: str, out: list[Event]) -> None:
        fmt = self.fmt
        sc = self._scanner
        if sc is not None:
            if sc.done:
                self._after_close(ch, out)
            else:
                sc.feed(ch, out)
                if sc.done:
                    self._end_call(out)
            return
        if self._in_array:
            if ch == "{":
                self._new_call().feed(ch, out)
            elif ch == "]":
                self._in_array = False
            return  # separators and layout inside the array
        if fmt.open:  # hermes: calls anywhere, each after `<tool_call>`
            self._marker += ch
            if fmt.open.startswith(self._marker):
                if self._marker == fmt.open:
                    self._marker = ""
                    self._new_call()
                return
            self._content(self._marker, out)
            self._marker = ""
            return
        if not self._started and fmt.first:  # the reply's first character decides
            if ch.isspace():
                self._space += ch
                return
            self._started = True
            if ch == fmt.first and fmt.open_token is None:
                if fmt.array:
                    self._in_array = True
                else:
                    self._new_call().feed(ch, out)
                return
        self._started = True
        self._content(ch, out)

    def _new_call(self) -> _CallScanner:
        self._scanner = _CallScanner(len(self.calls), _call_id(self.fmt.name), self.fmt.args_keys)
        self._after_call = ""
        self._started = True
        return self._scanner

    def _end_call(self, out: list[Event]) -> None:
        sc = self._scanner
        assert sc is not None
        if sc.finish(out):
            self.calls.append(ToolCall(sc.id, sc.name or "", _args_of(sc)))
            self._space = ""
        else:
            self._content("".join(sc.raw), out)
        if not self.fmt.close:
            self._scanner = None

    def _after_close(self, ch: str, out: list[Event]) -> None:
        """hermes: between a call object and its `</tool_call>`."""
        self._after_call += ch
        stripped = self._after_call.lstrip()
        if self.fmt.close.startswith(stripped):
            if stripped == self.fmt.close:
                self._scanner = None
            return
        self._content(self._after_call, out)  # not the marker after all
        self._scanner = None

    def close(self) -> list[Event]:
        """The output ended: release held-back text; an unfinished call becomes content."""
        out: list[Event] = []
        sc = self._scanner
        if sc is not None and not sc.done:
            if sc.started:  # cut off (max_tokens) inside a call: it stays a call, its arguments partial
                partial = "".join(sc.raw[sc.args_start:]) if sc.args_start >= 0 else ""
                self.calls.append(ToolCall(sc.id, sc.name or "", partial))
            else:
                self._content("".join(sc.raw), out)
        self._scanner = None
        if self._marker:
            self._content(self._marker, out)
            self._marker = ""
        if self._space and not self.calls:
            out.append(Content(self._space))
        self._space = ""
        return coalesce(out)


def _args_of(sc: _CallScanner) -> str:
    """The arguments as the model wrote them (what the stream sent), or re-encoded if it wrote none."""
    if sc.args_start >= 0 and sc.args_end >= 0:
        return "".join(sc.raw[sc.args_start : sc.args_end])
    obj = json.loads("".join(sc.raw))
    return json.dumps(next((obj[k] for k in sc.args_keys if k in obj), {}), ensure_ascii=False)


def coalesce(events: list[Event]) -> list[Event]:
    """Adjacent content (and adjacent argument fragments of one call) merged: one delta each."""
    out: list[Event] = []
    for e in events:
        last = out[-1] if out else None
        if isinstance(e, Content) and isinstance(last, Content):
            out[-1] = Content(last.text + e.text)
        elif isinstance(e, CallArgs) and isinstance(last, CallArgs) and last.index == e.index:
            out[-1] = CallArgs(e.index, last.fragment + e.fragment)
        else:
            out.append(e)
    return out


@dataclass
class ParsedReply:
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


def parse_reply(fmt: ToolFormat, text: str, token_ids: list[int] | None = None) -> ParsedReply:
    ex = fmt.extractor()
    events = ex.feed(text, token_ids) + ex.close()
    content = "".join(e.text for e in events if isinstance(e, Content))
    if ex.calls:
        content = content.strip()
    return ParsedReply(content or None if ex.calls else content, ex.calls)
