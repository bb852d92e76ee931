"""What every upstream yields, whatever it speaks (gRPC workers or OpenAI-compatible HTTP)."""

from __future__ import annotations

from dataclasses import dataclass, field


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


class WorkerError(Exception):
    """An upstream failed. `retryable`: another endpoint may succeed; `status`: HTTP status if not."""

    def __init__(self, message: str, *, retryable: bool, status: int = 502, failed: str | None = None,
                 failed_role: str | None = None):
        super().__init__(message)
        self.retryable = retryable
        self.status = status
        self.failed = failed  # the endpoint to blame (address)
        self.failed_role = failed_role
