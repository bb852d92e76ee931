"""A chat reply beyond plain text: reasoning and tool calls, read out of a worker's output as it
streams, for the OpenAI response (`message.reasoning_content`, `message.tool_calls`, their deltas)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from router.api.marked_calls import MarkedFormat, MarkerDecoder
from router.api.reasoning import ReasoningSplitter
from router.api.tool_calls import CallArgs, CallStart, Content, ToolCall, ToolFormat, coalesce


@dataclass
class Reasoning:
    text: str


ReplyEvent = Reasoning | Content | CallStart | CallArgs


@dataclass(frozen=True)
class ReplyPlan:
    """How to read one request's reply; None on a GenRequest means plain text."""

    tools: ToolFormat | MarkedFormat | None  # read tool calls in this format (tool_choice auto, required or named)
    reasoning: bool  # split off `<think>` reasoning
    reasoning_open: bool = False  # the prompt ended inside `<think>`: the reply starts as reasoning
    # Marked formats: the reply's text is its token ids decoded with these pieces (markers kept).
    marker_pieces: tuple[bytes, ...] | None = None

    def parser(self) -> ReplyParser:
        return ReplyParser(self)


class ReplyParser:
    def __init__(self, plan: ReplyPlan):
        self.splitter = ReasoningSplitter(plan.reasoning_open) if plan.reasoning else None
        self.extractor: Any = plan.tools.extractor() if plan.tools is not None else None
        self.decoder = MarkerDecoder(list(plan.marker_pieces)) if plan.marker_pieces is not None else None

    @property
    def calls(self) -> list[ToolCall]:
        return self.extractor.calls if self.extractor is not None else []

    def feed(self, text: str, token_ids: list[int] | None = None) -> list[ReplyEvent]:
        out: list[ReplyEvent] = []
        if self.decoder is not None:
            text = self.decoder.decode(token_ids or [])
        content = text
        if self.splitter is not None:
            reasoning, content = self.splitter.feed(text)
            if reasoning:
                out.append(Reasoning(reasoning))
            token_ids = None  # token-level markers are not used by reasoning models' formats
        self._content(content, token_ids, out)
        return out

    def close(self) -> list[ReplyEvent]:
        out: list[ReplyEvent] = []
        content = self.decoder.flush() if self.decoder is not None else ""
        if self.splitter is not None:
            reasoning, head = self.splitter.feed(content) if content else ("", "")
            more, tail = self.splitter.close()
            reasoning, content = reasoning + more, head + tail
            if reasoning:
                out.append(Reasoning(reasoning))
        self._content(content, None, out)
        if self.extractor is not None:
            out.extend(self.extractor.close())
        return coalesce(out)  # type: ignore[arg-type,return-value]

    def _content(self, text: str, token_ids: list[int] | None, out: list[ReplyEvent]) -> None:
        if self.extractor is not None:
            if text or token_ids:
                out.extend(self.extractor.feed(text, token_ids))
        elif text:
            out.append(Content(text))
