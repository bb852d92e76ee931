"""Tool-call formats written with marker tokens around a function name and its JSON arguments: the
DeepSeek-V3 / R1, DeepSeek-V3.1 and Kimi-K2 families (their chat templates render them so).

    DeepSeek-V3, R1   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
                      ```json
                      {ARGS}
                      ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
    DeepSeek-V3.1     <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{ARGS}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
    Kimi-K2           <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:INDEX
                      <|tool_call_argument_begin|>{ARGS}<|tool_call_end|>...<|tool_calls_section_end|>

The markers are special tokens of these models' vocabularies, which a worker's text leaves out: the
reply is read from its token ids, decoded with the markers kept (`ReplyParser`), and parsed as it
streams — the name when it is complete, the arguments as they arrive. Under a required or named
`tool_choice` a grammar writes the section (markers as the tokens they are, arguments by the tool's
schema).
"""

from __future__ import annotations

import codecs
import re
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common import grammar
from router.api.tool_calls import CallArgs, CallStart, Content, Event, ToolCall, ToolChoice, coalesce

if TYPE_CHECKING:
    from collections.abc import Callable


@dataclass(frozen=True)
class MarkedFormat:
    name: str
    section_open: str
    section_close: str
    call_open: str
    call_close: str
    name_prefix: str  # between the call's marker and the function name
    name_end: str  # after the name, before the arguments
    args_end: str  # after the arguments, before the call's closing marker ("" when none)
    kimi_ids: bool = False  # the name is `functions.NAME:INDEX`, which is also the call's id
    marker_ids: tuple[tuple[str, int], ...] = ()  # (marker, token id) for those that are single tokens

    @property
    def markers(self) -> tuple[str, ...]:
        """Every marker the format writes (some stand inside its other pieces: `function<｜tool▁sep｜>`)."""
        parts = (self.section_open, self.section_close, self.call_open, self.call_close, self.name_prefix,
                 self.name_end, self.args_end)
        return tuple(dict.fromkeys(m for p in parts for m in _MARKER.findall(p)))

    def with_ids(self, token_to_id: Callable[[str], int | None]) -> MarkedFormat:
        ids = tuple((m, i) for m in self.markers if (i := token_to_id(m)) is not None)
        return MarkedFormat(**{**self.__dict__, "marker_ids": ids})

    def _lit(self, text: str) -> str:
        """Lark items for `text`: each marker in it as its special token where it is one (`<[id]>`),
        the rest as literals."""
        ids = dict(self.marker_ids)
        items = []
        for part in _MARKER.split(text):
            if part in ids:
                items.append(f"<[{ids[part]}]>")
            elif part:
                items.append(grammar.lark_literal(part))
        return " ".join(items)

    def grammar(self, choice: ToolChoice) -> str:
        """Lark grammar for `required` / named choices: a section of one call (or several, if parallel)."""
        alts = []
        for i, tool in enumerate(choice.tools):
            name = f"functions.{tool.name}:0" if self.kimi_ids else tool.name
            head = [self._lit(self.name_prefix)] if self.name_prefix else []
            body = [*head, grammar.lark_literal(name), self._lit(self.name_end),
                    grammar.lark_json(tool.parameters)]
            if self.args_end:
                body.append(self._lit(self.args_end))
            alts.append(f"call{i}: {' '.join(body)}")
        call = f"call: {self._lit(self.call_open)} ({' | '.join(f'call{i}' for i in range(len(alts)))}) " \
               f"{self._lit(self.call_close)}"
        calls = "call+" if choice.parallel else "call"
        src = "\n".join([f"start: {self._lit(self.section_open)} {calls} {self._lit(self.section_close)}", call, *alts])
        return grammar.lark(src, "tools")

    def extractor(self) -> MarkedCallExtractor:
        return MarkedCallExtractor(self)


DEEPSEEK_V3 = MarkedFormat("deepseek_v3", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                           "<｜tool▁call▁end｜>", "function<｜tool▁sep｜>", "\n```json\n", "\n```")
DEEPSEEK_V31 = MarkedFormat("deepseek_v31", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                            "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "", "<｜tool▁sep｜>", "")
KIMI_K2 = MarkedFormat("kimi_k2", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                       "<|tool_call_end|>", "", "<|tool_call_argument_begin|>", "", kimi_ids=True)


def detect_marked(chat_template: str, token_to_id: Callable[[str], int | None]) -> MarkedFormat | None:
    if "<|tool_calls_section_begin|>" in chat_template:
        return KIMI_K2.with_ids(token_to_id)
    if "<｜tool▁calls▁begin｜>" in chat_template:
        # V3 / R1 write `function<｜tool▁sep｜>NAME` and a json fence; V3.1 writes `NAME<｜tool▁sep｜>ARGS`.
        fmt = DEEPSEEK_V3 if "function<｜tool▁sep｜>" in chat_template or "```json" in chat_template else DEEPSEEK_V31
        return fmt.with_ids(token_to_id)
    return None


_MARKER = re.compile(r"(<[｜|][^<>]*?[｜|]>)")
_KIMI_NAME = re.compile(r"^(?:functions\.)?(?P<name>[^:\s]+)(?::\d+)?$")


class MarkedCallExtractor:
    """Content and calls out of a reply in a marked format, fed as it streams and closed at the end."""

    def __init__(self, fmt: MarkedFormat):
        self.fmt = fmt
        self.calls: list[ToolCall] = []
        self.state = "content"  # content | section | name | args | after_args
        self.buf = ""  # text not yet decided on (a possible start of a marker, the name so far)
        self.args = ""  # the current call's arguments so far
        self.sent = 0  # of them, already emitted
        self.call: ToolCall | None = None

    def feed(self, text: str, token_ids: list[int] | None = None) -> list[Event]:
        out: list[Event] = []
        self.buf += text
        while self._step(out):
            pass
        return coalesce(out)

    def _held(self, marker: str) -> int:
        """Length of the longest tail of `buf` that could be the start of `marker`."""
        for k in range(min(len(marker) - 1, len(self.buf)), 0, -1):
            if marker.startswith(self.buf[-k:]):
                return k
        return 0

    def _step(self, out: list[Event]) -> bool:
        f = self.fmt
        if self.state == "content":
            i = self.buf.find(f.section_open)
            if i >= 0:
                if self.buf[:i]:
                    out.append(Content(self.buf[:i]))
                self.buf, self.state = self.buf[i + len(f.section_open):], "section"
                return True
            keep = self._held(f.section_open)
            if len(self.buf) > keep:
                out.append(Content(self.buf[: len(self.buf) - keep]))
                self.buf = self.buf[len(self.buf) - keep:]
            return False
        if self.state == "section":
            body = self.buf.lstrip()
            if body.startswith(f.call_open):
                self.buf, self.state = body[len(f.call_open):], "name"
                return True
            if body.startswith(f.section_close):
                self.buf, self.state = body[len(f.section_close):], "content"
                return True
            return False  # (wait for more)
        if self.state == "name":
            i = self.buf.find(f.name_end)
            if i < 0:
                return False
            raw = self.buf[:i].removeprefix(f.name_prefix).strip()
            call_id = raw if f.kimi_ids else f"call_{secrets.token_hex(12)}"
            m = _KIMI_NAME.match(raw) if f.kimi_ids else None
            self.call = ToolCall(call_id, m.group("name") if m else raw, "")
            out.append(CallStart(len(self.calls), self.call.id, self.call.name))
            self.buf, self.state, self.args, self.sent = self.buf[i + len(f.name_end):], "args", "", 0
            return True
        if self.state == "args":
            end = (f.args_end + f.call_close) if f.args_end else f.call_close
            i = self.buf.find(end)
            done = i >= 0
            take = self.buf[:i] if done else self.buf[: len(self.buf) - self._held(end)]
            self.args += take
            self.buf = self.buf[i + len(end):] if done else self.buf[len(take):]
            self._emit(out, final=done)
            if done:
                self._close_call()
                self.state = "section"
            return done
        return False

    def _emit(self, out: list[Event], final: bool) -> None:
        """Argument characters not yet sent: the arguments are exactly what stands between the markers."""
        if len(self.args) > self.sent:
            out.append(CallArgs(len(self.calls), self.args[self.sent:]))
            self.sent = len(self.args)

    def _close_call(self) -> None:
        assert self.call is not None
        self.calls.append(ToolCall(self.call.id, self.call.name, self.args))
        self.call = None

    def close(self) -> list[Event]:
        out: list[Event] = []
        if self.state == "args" and self.call is not None:  # cut off (max_tokens): partial arguments
            self.args += self.buf
            self._emit(out, final=True)
            self._close_call()
        elif self.state == "content" and self.buf:
            out.append(Content(self.buf))
        self.buf = ""
        return coalesce(out)


class MarkerDecoder:
    """The reply's token ids as text with the format's marker tokens kept (every other special token
    dropped, as the worker's text drops them): a byte table and an incremental UTF-8 decoder."""

    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def decode(self, ids: list[int]) -> str:
        n = len(self.pieces)
        return self.utf8.decode(b"".join(self.pieces[i] for i in ids if 0 <= i < n))

    def flush(self) -> str:
        return self.utf8.decode(b"", True)


def marker_pieces(byte_pieces: list[bytes], fmt: MarkedFormat) -> list[bytes]:
    """A tokenizer's byte table with the format's marker tokens spelled out."""
    pieces = list(byte_pieces)
    for marker, i in fmt.marker_ids:
        if 0 <= i < len(pieces):
            pieces[i] = marker.encode()
    return pieces
