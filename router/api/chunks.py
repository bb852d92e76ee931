"""What every upstream yields, whatever it speaks (gRPC workers or OpenAI-compatible HTTP)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Chunk:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prefill_mode: str = ""
    stop_reason: str | int | None = None  # on the finish: the stop string or stop token id that ended it
    # From OpenAI-compatible upstreams, passed through as they sent them: delta fields beyond the
    # text (tool_calls, reasoning_content) merged over one read, and their logprobs object.
    extra: dict[str, Any] | None = None
    raw_logprobs: dict[str, Any] | None = None

    @property
    def has_output(self) -> bool:
        return bool(self.text or self.token_ids or self.logprobs or self.extra or self.raw_logprobs)


def merge_delta_extra(into: dict[str, Any], delta: dict[str, Any]) -> None:
    """Fold one upstream delta's non-text fields into a read's merged delta: reasoning text is
    concatenated; a tool-call entry continuing the previous one (same index, no new id) has its
    argument fragment appended, any other is a new entry (clients accumulate by index)."""
    for key, value in delta.items():
        if key in ("content", "role") or value is None:
            continue
        if key == "tool_calls":
            calls = into.setdefault("tool_calls", [])
            for tc in value:
                last = calls[-1] if calls else None
                fn = tc.get("function") or {}
                if last is not None and last.get("index") == tc.get("index") and not tc.get("id") and not fn.get("name"):
                    lf = last.setdefault("function", {})
                    lf["arguments"] = (lf.get("arguments") or "") + (fn.get("arguments") or "")
                else:
                    calls.append(json.loads(json.dumps(tc)))  # a copy: later fragments extend it
        elif isinstance(value, str):
            into[key] = into.get(key, "") + value
        else:
            into[key] = value


def merge_logprobs(into: dict[str, Any] | None, lp: dict[str, Any]) -> dict[str, Any]:
    """Concatenate OpenAI logprobs objects (chat: `content` lists; completions: parallel lists)."""
    if into is None:
        return json.loads(json.dumps(lp))
    for key, value in lp.items():
        if isinstance(value, list):
            into.setdefault(key, []).extend(value)
    return into


class WorkerError(Exception):
    """An upstream failed. `retryable`: another endpoint may succeed; `status`: HTTP status if not."""

    def __init__(self, message: str, *, retryable: bool, status: int = 502, failed: str | None = None,
                 failed_role: str | None = None):
        super().__init__(message)
        self.retryable = retryable
        self.status = status
        self.failed = failed  # the endpoint to blame (address)
        self.failed_role = failed_role
