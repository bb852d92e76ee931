"""What the engine hands out: a request's new tokens and text per step (`RequestOutput`), its counters
(`EngineStats`), and the hook that sees each forward pass layer by layer (`StepObserver`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from engine.batch.block_manager import BlockStats
from engine.batch.scheduler import ScheduledSeq
from engine.batch.sequence import TokenLogprob


class StepObserver(Protocol):
    """Sees each forward pass layer by layer (the prefill worker's KV transfer plugs in here)."""

    def before_forward(self, batch: list[ScheduledSeq]) -> None: ...

    def after_layer(self, layer: int) -> None: ...

    def after_forward(self) -> dict[str, str]:
        """Waits for work started per layer; returns {request_id: error} for sequences that failed."""
        ...


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int] = field(default_factory=list)  # new since the last output
    text: str = ""  # new text since the last output
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error | prefill
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    # What stopped a "stop" finish (vLLM's stop_reason): the stop string matched, the stop token id, or
    # None (end of sequence, or a completed grammar).
    stop_reason: str | int | None = None

    def merge(self, later: RequestOutput) -> None:
        """Fold a later output of the same request into this one (a reader that fell behind)."""
        self.token_ids += later.token_ids
        self.text += later.text
        self.logprobs += later.logprobs
        self.finished, self.finish_reason, self.error = later.finished, later.finish_reason, later.error
        self.stop_reason = later.stop_reason
        self.num_output_tokens = later.num_output_tokens
        self.num_prompt_tokens = later.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = later.num_cached_tokens or self.num_cached_tokens


@dataclass
class EngineStats:
    blocks: BlockStats
    running: int
    waiting: int
    reserved: int
    num_preemptions: int
    prompt_tokens_in_flight: int  # prompt tokens not yet computed, queued or running
    kv_tokens_held: int = 0
    decode_tokens_remaining: int = 0
    store_hit_tokens: int = 0  # prompt tokens filled from the cluster-wide KV tier so far
    spec_drafted: int = 0  # speculative tokens proposed so far
    spec_accepted: int = 0  # of those, accepted by verification
