"""A request inside the engine: its tokens, its block table and how far it has been computed."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from common.block_hash import cache_scope
from common.detokenizer import Detokenizer
from common.sampling_params import SamplingParams

# Async scheduling: an output token the device has sampled and the host has not read yet (the last of
# `output_token_ids` while its step is queued; LLMEngine replaces it when it reads the step).
PENDING = -1


class Status(enum.Enum):
    WAITING = "waiting"  # queued, holds no blocks
    RESERVED = "reserved"  # holds blocks that another process is filling (disaggregated decode)
    RUNNING = "running"
    FINISHED = "finished"


class Mode(enum.Enum):
    FULL = "full"  # prefill then decode here (colocated)
    PREFILL_ONLY = "prefill_only"  # prefill, sample the first token, stop (prefill worker)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(eq=False)  # identity semantics: two requests are never "equal"
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    tenant: str = ""
    weight: float = 1.0  # the tenant's share of the batch against other tenants (scheduler.py)
    priority: int = 0  # lower is more important: admitted first, preempted last (scheduler.py)
    adapter: str = ""  # the LoRA adapter it runs under ("" = the base model)
    lora_slot: int = -1  # that adapter's slot in the model's LoRA factors (-1: the base model)
    mode: Mode = Mode.FULL
    arrival: int = 0  # admission order; preemption takes the newest first
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    # Spare blocks a prefill worker writes whole pages into, moved into block_table[landing_from:] on
    # arrival (`KVCache.land`); held like the block table until then.
    landing: list[int] = field(default_factory=list)
    landing_from: int = 0
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # of those, how many came from the prefix cache at admission
    num_registered_blocks: int = 0  # leading full blocks already entered in the prefix cache
    num_published_blocks: int = 0  # leading full blocks handed to the cluster-wide KV tier (or taken from it)
    fetch: bool = False  # once admitted, wait for the KV tier to fill blocks past the local hit before computing
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of the full blocks so far
    status: Status = Status.WAITING
    finish_reason: str | None = None
    error: str | None = None
    matcher: Any = None  # llguidance matcher when the request is constrained by a grammar
    grammar_branch_known: bool = False  # (SamplingParams.grammar_release) the output has opened
    detok: Detokenizer | None = None
    num_preemptions: int = 0
    spec: Any = None  # engine.speculative.SpecState once the sequence has been drafted for
    # Its decode steps may be queued before the last one's token is read (async scheduling): greedy or
    # sampled, no logprobs, penalties, grammar or adapter (set by the engine at admission).
    overlappable: bool = False

    @property
    def scope(self) -> str:
        """What its KV blocks are shared within (`common.block_hash.cache_scope`)."""
        return cache_scope(self.tenant, self.adapter)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """`all_token_ids[start:end]` without building the whole list (a decode step reads one token)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def generated_token_ids(self) -> list[int]:
        """This request's output so far, including what a failed earlier attempt produced (which
        arrives as the end of the prompt): what penalties count and seeded noise is indexed by."""
        k = self.sampling.resumed_tokens
        return (self.prompt_token_ids[-k:] if k else []) + self.output_token_ids

    @property
    def num_generated(self) -> int:
        return self.sampling.resumed_tokens + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_remaining(self) -> int:
        """Tokens still to run through the model; 1 means a plain decode step."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED
