"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step, running decodes go first (one token each), so inter-token latency stays
steady; the rest of the token budget goes to prompts in chunks, so a long prompt
delays running decodes by at most one budget's worth of compute, and a prompt in
progress leaves part of the budget to newly arrived ones. When a decode needs
a block and none is free, the newest sequence is preempted: its blocks are freed (full
ones stay in the prefix cache) and it is recomputed later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from engine.batch.block_manager import BlockManager
from engine.batch.sequence import Sequence, Status


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # per-step token budget: the prefill chunk size
    # Prompt tokens a step may carry while sequences are decoding (None: the whole budget). A step's
    # time grows with its prompt tokens, and every running stream waits for it: a smaller chunk
    # bounds their inter-token latency at the cost of time to first token.
    max_prefill_tokens_while_decoding: int | None = None


class Chunked(Protocol):
    """What `ModelRunner.prepare` reads of a sequence: a `Sequence`, or a drafter's own per-sequence
    state over its own KV cache (`speculative.PagedDrafter`)."""

    @property
    def all_token_ids(self) -> list[int]: ...

    @property
    def block_table(self) -> list[int]: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    def tokens(self, start: int, end: int) -> list[int]: ...


S = TypeVar("S", bound=Chunked)


@dataclass(eq=False)
class ScheduledSeq(Generic[S]):
    seq: S
    num_tokens: int  # tokens computed this step, from seq.num_computed_tokens
    draft: list[int] = field(default_factory=list)  # speculative tokens fed after the sequence's last one
    targets: list[int] = field(default_factory=list)  # the tokens drawn at each drafted row (set by the runner)
    features: Any = None  # EAGLE-3: the target's auxiliary hidden states of this entry's rows (set by the runner)

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the sequence, so its last row yields a token
        (a speculative step yields one per row)."""
        return bool(self.draft) or self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager):
        if config.max_num_batched_tokens < config.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (every decode needs one token)")
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_prefix_waits = 0  # steps a waiting prompt sat out to reuse a prefix being computed
        self.admitted_for_fetch: list[Sequence] = []  # admitted with blocks, to be filled from the KV tier
        self.drafter: Any = None  # engine.speculative.NgramDrafter when speculation is on
        self.max_model_len = 1 << 30

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence that already holds its blocks and computed K/V (disaggregated decode)."""
        seq.status = Status.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt_newest(self) -> Sequence:
        victim = max(self.running, key=lambda s: s.arrival)
        self.running.remove(victim)
        self.blocks.register_computed(victim)
        self.blocks.free_seq(victim)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.status = Status.WAITING
        self.waiting.appendleft(victim)
        self.num_preemptions += 1
        return victim

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.config.max_num_batched_tokens
        out: list[ScheduledSeq] = []
        # 1. Decodes, oldest first; a decode that needs a block preempts the newest sequence.
        decodes: list[Sequence] = []
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq not in self.running or seq.num_remaining != 1:
                continue
            while not self.blocks.grow(seq, seq.num_tokens):
                if self._preempt_newest() is seq:
                    break
            if seq in self.running:
                decodes.append(seq)  # a later decode's preemption takes only sequences newer than itself
        drafts = self._drafts(decodes, budget)
        for seq, draft in zip(decodes, drafts, strict=True):
            out.append(ScheduledSeq(seq, 1 + len(draft), draft))
            budget -= 1 + len(draft)
        cap = self.config.max_prefill_tokens_while_decoding
        if out and cap is not None:
            budget = min(budget, cap)
        # 2. Prompts already under way (their blocks were allocated at admission). While others
        #    wait, they leave up to half the budget to them: a short prompt arriving behind a long
        #    one starts at the next step instead of after the whole long prefill.
        reserve = min(budget // 2, sum(s.num_remaining for s in self.waiting)) if self.waiting else 0
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if budget - reserve <= 0:
                break
            if seq.num_remaining > 1:
                n = min(seq.num_remaining, budget - reserve)
                out.append(ScheduledSeq(seq, n))
                budget -= n
        # 3. New (or preempted) sequences, first come first served, while blocks last. One whose
        #    next uncached block another prompt is computing right now waits for it (a burst of
        #    requests sharing a new system prompt computes it once, not once per request).
        computing = self._prefix_in_progress() if self.waiting and self.blocks.enable_prefix_cache else set()
        deferred: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if computing and self.blocks.first_uncached(seq) in computing:
                deferred.append(self.waiting.popleft())
                self.num_prefix_waits += 1
                continue
            if not self.blocks.allocate(seq, seq.num_tokens):
                break
            self.waiting.popleft()
            if seq.fetch:  # its turn came: blocks now, filled from the KV tier before it computes
                seq.fetch = False
                seq.status = Status.RESERVED
                self.admitted_for_fetch.append(seq)
                continue
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = min(seq.num_remaining, budget)
            out.append(ScheduledSeq(seq, n))
            budget -= n
            if self.blocks.enable_prefix_cache:
                computing.update(seq.block_hashes[seq.num_registered_blocks :])
        self.waiting.extendleft(reversed(deferred))
        return out

    def _drafts(self, decodes: list[Sequence], budget: int) -> list[list[int]]:
        """Speculative tokens for each decode, proposed together (a draft model batches them), never at
        the cost of a preemption or the step budget: each sequence's room assumes the ones before it
        drafted in full."""
        if self.drafter is None or not decodes:
            return [[] for _ in decodes]
        rooms = []
        for seq in decodes:
            room = min(seq.sampling.max_tokens - len(seq.output_token_ids) - 1,
                       self.max_model_len - seq.num_tokens - 1, budget - len(self.running))
            rooms.append(room)
            budget -= 1 + max(0, min(room, self.drafter.k))
        drafts = self.drafter.propose_many(decodes, len(self.running), rooms)
        return [d if d and self.blocks.grow(seq, seq.num_tokens + len(d)) else []
                for seq, d in zip(decodes, drafts, strict=True)]

    def _prefix_in_progress(self) -> set[bytes]:
        """Hashes of prompt blocks that running prefills will compute but have not yet."""
        out: set[bytes] = set()
        for seq in self.running:
            if seq.num_remaining > 1:
                out.update(seq.block_hashes[seq.num_registered_blocks :])
        return out
