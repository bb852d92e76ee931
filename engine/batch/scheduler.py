"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step, running decodes go first (one token each), so inter-token latency stays
steady; the rest of the token budget goes to prompts in chunks, so a long prompt
delays running decodes by at most one budget's worth of compute, and a prompt in
progress leaves part of the budget to newly arrived ones. When a decode needs
a block and none is free, the newest sequence is preempted: its blocks are freed (full
ones stay in the prefix cache) and it is recomputed later.

Tenants (`Sequence.tenant`, `Sequence.weight`): once sequences of more than one tenant have been
seen, a tenant's share is its running sequences over its weight. Waiting prompts are admitted, and
prompts under way get their chunks, in order of share (the smallest first; arrival breaks ties);
preemption for blocks takes the newest sequence of the tenant most over its share; and a tenant
under its share that cannot be admitted (no sequence slot or blocks left) preempts the newest
sequence of the tenant most over its share, when the swap leaves that tenant still at or above
it; and the prompt of a tenant under its share is not held to the cap on prompt tokens while
others decode (`max_prefill_tokens_while_decoding`): it takes what is left of the step's budget.
So a tenant is never queued behind another's backlog, and two saturating tenants of weights 2 and 1
hold the batch 2:1. With one tenant, all of this is first come, first served.

Priorities (`Sequence.priority`, lower is more important; vLLM's `--scheduling-policy priority`): once
sequences of more than one priority have been seen, the most important come first everywhere — waiting
prompts are admitted, prompts under way get their chunks and decodes get their blocks in priority
order (then as above: share, arrival); preemption takes the least important running sequence (then as
above); and a waiting prompt that cannot be admitted preempts running sequences less important than
it until it can. Tenant fairness holds inside a priority.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
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
    # True when this step reaches the end of the sequence, so its last row yields a token (a
    # speculative step yields one per row). Fixed when the entry is made: a step reads it about six
    # times per sequence (preparing, sampling, committing) and nothing moves the sequence in between.
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = bool(self.draft) or self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


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
        self.first_tenant: str | None = None
        self.tenanted = False  # sequences of more than one tenant have been seen: scheduling is fair
        self.num_fair_preemptions = 0  # preemptions that made room for a tenant under its share
        self.last_for_newcomers = False  # the last step was given to tenants with nothing running
        self.first_priority: int | None = None
        self.prioritized = False  # sequences of more than one priority have been seen
        self.num_priority_preemptions = 0  # preemptions that made room for a more important prompt

    def _seen(self, seq: Sequence) -> None:
        if self.first_tenant is None:
            self.first_tenant = seq.tenant
        elif seq.tenant != self.first_tenant or seq.weight != 1.0:
            self.tenanted = True
        if self.first_priority is None:
            self.first_priority = seq.priority
        elif seq.priority != self.first_priority:
            self.prioritized = True

    def add(self, seq: Sequence) -> None:
        self._seen(seq)
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence that already holds its blocks and computed K/V (disaggregated decode)."""
        self._seen(seq)
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

    def shares(self) -> dict[str, float]:
        """Each tenant with running sequences: their number over its weight."""
        out: dict[str, float] = {}
        for s in self.running:
            out[s.tenant] = out.get(s.tenant, 0.0) + 1.0 / s.weight
        return out

    def _victim(self) -> Sequence:
        """The sequence to preempt: the newest, of the least important priority (prioritized), of the
        tenant most over its share among those (tenanted)."""
        pool = self.running
        if self.prioritized:
            least = max(s.priority for s in pool)
            pool = [s for s in pool if s.priority == least]
        if self.tenanted:
            shares = self._shares_of(pool)
            most = max(shares, key=lambda t: shares[t])
            pool = [s for s in pool if s.tenant == most]
        return max(pool, key=lambda s: s.arrival)

    @staticmethod
    def _shares_of(seqs: list[Sequence]) -> dict[str, float]:
        out: dict[str, float] = {}
        for s in seqs:
            out[s.tenant] = out.get(s.tenant, 0.0) + 1.0 / s.weight
        return out

    def _make_room_by_priority(self) -> None:
        """Preempt the least important running sequences, while the most important waiting prompt
        cannot be admitted (no sequence slot, or too few blocks) and some running one is less
        important than it."""
        head = min(self.waiting, key=lambda s: (s.priority, s.arrival))
        while (len(self.running) >= self.config.max_num_seqs
               or self.blocks.num_available < self.blocks.blocks_for(head.num_tokens)):
            victim = self._victim() if self.running else None
            if victim is None or victim.priority <= head.priority:
                return
            self._preempt(victim)
            self.num_priority_preemptions += 1

    def _preempt(self, victim: Sequence) -> Sequence:
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
        own_step: Callable[[Sequence], bool] | None = None  # the prompts a step of their own is for
        if self.prioritized and self.waiting:
            self._make_room_by_priority()
            # Most important first; within a priority, as before (a preempted sequence keeps its arrival).
            self.waiting = deque(sorted(self.waiting, key=lambda s: (s.priority, s.arrival)))
        if self.tenanted and self.waiting:
            self._make_room()
            if not self.last_for_newcomers:
                newcomers = self._newcomers()
                if newcomers:
                    own_step = lambda s: s.tenant in newcomers  # noqa: E731
        if own_step is None and self.prioritized and self.waiting and self.running and not self.last_for_newcomers:
            best = self.waiting[0].priority
            if best < min(s.priority for s in self.running):
                own_step = lambda s: s.priority == best  # noqa: E731
        # Tenanted, a tenant with prompts waiting and nothing running gets a step of its own
        # (never two in a row): its first token does not wait on a step stretched by everyone
        # else's batch; their streams wait that one step. Prioritized, so do prompts more important
        # than everything running.
        self.last_for_newcomers = alone = own_step is not None
        out = self._decodes(alone)
        full = self.config.max_num_batched_tokens - sum(s.num_tokens for s in out)
        cap = self.config.max_prefill_tokens_while_decoding
        budget = min(full, cap) if out and cap is not None else full
        # Tenanted: prompts of a tenant under its share are not held to the cap on prompt tokens
        # while others decode (their streams wait one longer step; its prompt does not wait behind
        # their backlog for several).
        shares = self.shares() if self.tenanted else None
        favoured = self._favoured(shares) if shares is not None and budget < full else set()
        used = self._chunks(out, alone, shares, favoured, full, budget)
        self._admit(out, own_step, shares, favoured, full, budget, used)
        return out

    def _decodes(self, newcomers: bool) -> list[ScheduledSeq]:
        """1. Decodes, oldest first (none in a newcomers' step); a decode that needs a block preempts the
        newest sequence. With a drafter, each decode carries its drafts."""
        decodes: list[Sequence] = []
        # (A preempted sequence leaves `running` with status WAITING: the status is the O(1) membership
        # test — `in self.running` made every step quadratic in the batch.)
        order = (lambda s: (s.priority, s.arrival)) if self.prioritized else (lambda s: s.arrival)
        for seq in sorted(self.running, key=order) if not newcomers else ():
            if seq.status != Status.RUNNING or seq.num_remaining != 1:
                continue
            while not self.blocks.grow(seq, seq.num_tokens):
                if self._preempt(self._victim()) is seq:
                    break
            if seq.status == Status.RUNNING:
                decodes.append(seq)
        if self.tenanted or self.prioritized:  # a later decode's preemption may have taken an earlier one
            decodes = [s for s in decodes if s.status == Status.RUNNING]
        drafts = self._drafts(decodes, self.config.max_num_batched_tokens)
        return [ScheduledSeq(seq, 1 + len(draft), draft) for seq, draft in zip(decodes, drafts, strict=True)]

    def _chunks(self, out: list[ScheduledSeq], newcomers: bool, shares: dict[str, float] | None,
                favoured: set[str], full: int, budget: int) -> int:
        """2. Prompts already under way (their blocks were allocated at admission). While others wait, they
        leave up to half the budget to them: a short prompt arriving behind a long one starts at the next
        step instead of after the whole long prefill. Returns the prompt tokens scheduled."""
        reserve = min(budget // 2, sum(s.num_remaining for s in self.waiting)) if self.waiting else 0
        used = 0
        key = (lambda s: s.arrival) if shares is None else (lambda s: (shares[s.tenant], s.arrival))
        if self.prioritized:
            key = (lambda k: lambda s: (s.priority, k(s)))(key)
        for seq in sorted(self.running, key=key) if not newcomers else ():
            if seq.num_remaining > 1:
                room = full - used if seq.tenant in favoured else budget - reserve - used
                if room <= 0:
                    continue  # (the favoured may still have room: they may take the whole step)
                n = min(seq.num_remaining, room)
                out.append(ScheduledSeq(seq, n))
                used += n
        return used

    def _admit(self, out: list[ScheduledSeq], own_step: Callable[[Sequence], bool] | None,
               shares: dict[str, float] | None,
               favoured: set[str], full: int, budget: int, used: int) -> None:
        """3. New (or preempted) sequences, first come first served (tenanted: in share order), while blocks
        last. One whose next uncached block another prompt is computing right now waits for it (a burst of
        requests sharing a new system prompt computes it once, not once per request)."""
        computing = self._prefix_in_progress() if self.waiting and self.blocks.enable_prefix_cache else set()
        deferred: list[Sequence] = []
        queue = (self.waiting if shares is None and own_step is None
                 else _FairQueue(self.waiting, shares or {}, own_step))
        while queue and len(self.running) < self.config.max_num_seqs:
            seq = queue[0]
            room = (full if seq.tenant in favoured else budget) - used
            if room <= 0:
                break
            if computing and self.blocks.first_uncached(seq) in computing:
                deferred.append(queue.popleft())
                self.num_prefix_waits += 1
                continue
            if not self.blocks.allocate(seq, seq.num_tokens):
                break
            queue.popleft()
            if seq.fetch:  # its turn came: blocks now, filled from the KV tier before it computes
                seq.fetch = False
                seq.status = Status.RESERVED
                self.admitted_for_fetch.append(seq)
                continue
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = min(seq.num_remaining, room)
            out.append(ScheduledSeq(seq, n))
            used += n
            if self.blocks.enable_prefix_cache:
                computing.update(seq.block_hashes[seq.num_registered_blocks :])
        if isinstance(queue, _FairQueue):
            self.waiting = queue.rest()
        self.waiting.extendleft(reversed(deferred))

    def _newcomers(self) -> set[str]:
        """Tenants with prompts waiting and no sequence running, when others have some running."""
        if not self.running:
            return set()
        active = {s.tenant for s in self.running}
        return {s.tenant for s in self.waiting if s.tenant not in active}

    def _favoured(self, shares: dict[str, float]) -> set[str]:
        """Tenants with work here whose share, one sequence more, is still at most the largest."""
        top = max(shares.values(), default=0.0)
        out = set()
        for s in self.waiting:
            if s.tenant not in out and shares.get(s.tenant, 0.0) + 1.0 / s.weight <= top:
                out.add(s.tenant)
        for s in self.running:
            if s.tenant not in out and s.num_remaining > 1 and shares[s.tenant] + 1.0 / s.weight <= top:
                out.add(s.tenant)
        return out

    def _make_room(self) -> None:
        """Preempt for the waiting tenant with the smallest share, while it cannot be admitted (no
        sequence slot, or too few blocks for its next prompt) and the tenant most over its share
        would, one sequence fewer, still be at or above it with one more."""
        waiting: list[Sequence] | deque[Sequence] = self.waiting
        best = None
        if self.prioritized:  # only for the most important waiting, and never at a more important one's cost
            best = min(s.priority for s in waiting)
            waiting = [s for s in waiting if s.priority == best]
        weights = {s.tenant: s.weight for s in waiting}
        heads: dict[str, Sequence] = {}
        for s in waiting:
            heads.setdefault(s.tenant, s)
        while self.running:
            shares = self.shares()
            tenant = min(weights, key=lambda t: (shares.get(t, 0.0), heads[t].arrival))
            head = heads[tenant]
            if (len(self.running) < self.config.max_num_seqs
                    and self.blocks.num_available >= self.blocks.blocks_for(head.num_tokens)):
                return
            most = max(shares, key=lambda t: shares[t])
            pool = [s for s in self.running if s.tenant == most and (best is None or s.priority >= best)]
            if not pool:
                return
            if shares[most] - 1.0 / pool[0].weight < shares.get(tenant, 0.0) + 1.0 / head.weight:
                return
            self._preempt(max(pool, key=lambda s: s.arrival))
            self.num_fair_preemptions += 1

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


class _FairQueue:
    """The waiting prompts in the order a tenanted step admits them: each next one from the tenant
    whose share, counting it, would be smallest (first come, first served within a tenant). Holds
    the deque's interface that step 3 uses; `rest()` is what was not taken, in arrival order."""

    def __init__(self, waiting: deque[Sequence], shares: dict[str, float],
                 only: Callable[[Sequence], bool] | None = None):
        self.queues: dict[str, deque[Sequence]] = {}
        for s in waiting:
            if only is None or only(s):
                self.queues.setdefault(s.tenant, deque()).append(s)
        self.shares = dict(shares)
        self.taken: set[int] = set()
        self.waiting = waiting
        self._pick()

    def _pick(self) -> None:
        live = [t for t, q in self.queues.items() if q]
        if live:  # the most important priority first (each tenant's queue is in priority order)
            best = min(self.queues[t][0].priority for t in live)
            live = [t for t in live if self.queues[t][0].priority == best]
        self.tenant = (min(live, key=lambda t: (self.shares.get(t, 0.0) + 1.0 / self.queues[t][0].weight,
                                                self.queues[t][0].arrival)) if live else None)

    def __bool__(self) -> bool:
        return self.tenant is not None

    def __getitem__(self, i: int) -> Sequence:
        assert i == 0 and self.tenant is not None
        return self.queues[self.tenant][0]

    def popleft(self) -> Sequence:
        assert self.tenant is not None
        seq = self.queues[self.tenant].popleft()
        self.taken.add(id(seq))
        self.shares[seq.tenant] = self.shares.get(seq.tenant, 0.0) + 1.0 / seq.weight
        self._pick()
        return seq

    def rest(self) -> deque[Sequence]:
        return deque(s for s in self.waiting if id(s) not in self.taken)
