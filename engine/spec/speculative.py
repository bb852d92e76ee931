"""Speculative decoding, lossless for greedy and sampled requests: the drafters and the verification rule.

A drafter proposes up to k tokens for a running sequence. Prompt lookup (`NgramDrafter`) finds
the latest earlier occurrence of its last n tokens (n = 3, 2, 1) in the prompt and output so far
and copies what followed; a draft model (`draft_model.DraftModelDrafter`) decodes them greedily
with a smaller model of the same tokenizer. The target model then computes the fed token plus the k drafts in one step (as a
chunk over the paged KV cache). At each row the sampler draws the token it would have drawn
without speculation (greedy: the argmax; sampled: the same draw, from the generator of that
token's index when seeded); drafts equal to those tokens are accepted, followed by the drawn
token at the first disagreement (or after the last draft). Every emitted token is therefore a
draw from the target distribution given the tokens before it — for a point-mass draft this
is exactly speculative rejection sampling (accept with p(draft), else a draw from p without
the draft) — and a seeded request emits the very tokens it would without speculation.
Rejected positions' K/V slots are simply not counted as computed and are overwritten later.

k adapts per sequence: drafts that keep missing make it skip drafting (a one-token probe every
`PROBE_EVERY` steps), so text that never repeats costs almost nothing.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

import torch

from engine.batch.model_runner import ModelRunner
from engine.batch.scheduler import ScheduledSeq
from engine.batch.sequence import Mode, Sequence
from engine.model.attention import AttentionMetadata

NGRAM_SIZES = (3, 2, 1)
PROBE_EVERY = 8  # steps between drafts while a sequence's acceptance is low
LOW_ACCEPTANCE = 0.25


@dataclass
class SpecState:
    """Per-sequence speculation bookkeeping."""

    acceptance: float = 1.0  # moving average of accepted / drafted
    idle_steps: int = 0
    draft_cache: Any = None  # a draft model's per-sequence KV state (draft_model.DraftSeq)


def eligible(seq: Sequence) -> bool:
    """Speculation runs where each row's token depends only on that row's logits and the token's
    index: no penalties, biases or min_tokens (they change with the tokens before), no grammar,
    no logprobs."""
    sp = seq.sampling
    return seq.mode == Mode.FULL and not sp.penalized and seq.matcher is None and sp.logprobs is None


def ngram_draft(tokens: list[int], k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the last n tokens."""
    if k <= 0 or len(tokens) < 2:
        return []
    buf = array("i", tokens).tobytes()
    for n in NGRAM_SIZES:
        if len(tokens) <= n:
            continue
        pattern = buf[-4 * n:]
        end = len(buf) - 4  # an occurrence must end before the last token
        while True:
            pos = buf.rfind(pattern, 0, end)
            if pos < 0:
                break
            if pos % 4 == 0:  # aligned on a token
                start = pos // 4 + n
                return tokens[start:start + k]
            end = pos + 4 * n - 1
    return []


class Drafter:
    """What every drafter shares: eligibility, the batch-size off-switch, per-sequence adaptive k."""

    def __init__(self, k: int, max_batch: int):
        self.k = k
        self.max_batch = max_batch  # above this many running sequences, verification costs more than it saves
        self.drafted = 0
        self.accepted = 0
        self.steps = 0

    def propose_many(self, seqs: list[Sequence], running: int, rooms: list[int]) -> list[list[int]]:
        """Drafts for each of this step's decodes (room: tokens each may still add before max_tokens /
        context)."""
        ks = [self._budget(seq, running, room) for seq, room in zip(seqs, rooms, strict=True)]
        return self.draft_many(seqs, ks)

    def _budget(self, seq: Sequence, running: int, room: int) -> int:
        """How many tokens to draft for `seq` now: 0 above the batch limit, for ineligible requests, or
        between the probes of a sequence whose drafts keep missing."""
        if running > self.max_batch or not eligible(seq):
            return 0
        st: SpecState = seq.spec if seq.spec is not None else SpecState()
        seq.spec = st
        k = max(0, min(self.k, room))
        if st.acceptance < LOW_ACCEPTANCE:
            st.idle_steps += 1
            if st.idle_steps < PROBE_EVERY:
                return 0
            st.idle_steps = 0
            k = min(k, 1)  # a probe drafts one token: a 2-row step, not 5, while drafts keep missing
        return k

    def draft_many(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        return [self.draft_tokens(seq, k) if k > 0 else [] for seq, k in zip(seqs, ks, strict=True)]

    def draft_tokens(self, seq: Sequence, k: int) -> list[int]:
        raise NotImplementedError

    def release(self, seq: Sequence) -> None:
        """The sequence is finished or stopped: drop whatever the drafter holds for it."""

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        st = seq.spec
        if st is None or drafted == 0:
            return
        st.acceptance = 0.7 * st.acceptance + 0.3 * (accepted / drafted)
        self.drafted += drafted
        self.accepted += accepted
        self.steps += 1


class PagedDrafter(Drafter):
    """A drafter with its own paged KV cache (a draft model's, an EAGLE-3 head's): a free list of its
    blocks, handed to a sequence's draft state (`SpecState.draft_cache`, which has a `block_table`) as
    its drafts need them and taken back when the sequence ends.

    `draft_many` is the batched loop both share: one forward feeds every sequence's catch-up chunk
    side by side, then one forward per further draft, batched like the target's decodes. A subclass
    says how a state catches up (`_catch_up`), how one forward turns into next tokens (`_forward`), how
    a draft is fed back (`_feed`) and what stays valid when a sequence's proposal ends (`_done`)."""

    runner: ModelRunner  # over the drafter's own model and KV cache (set by the subclass)

    def __init__(self, k: int, max_batch: int, num_blocks: int, block_size: int):
        super().__init__(k, max_batch)
        self.block_size = block_size
        self.free = list(range(num_blocks - 1, -1, -1))  # a stack: the most recently freed block is reused first

    def draft_many(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in seqs]
        want: dict[int, tuple[int, int]] = {}  # id(draft state) -> (index in seqs, k)
        active: list[Any] = []
        for i, (seq, k) in enumerate(zip(seqs, ks, strict=True)):
            d = self._catch_up(seq, k) if k > 0 else None
            if d is not None:
                want[id(d)] = (i, k)
                active.append(d)
        with torch.inference_mode():
            while active:
                batch = [ScheduledSeq(d, d.num_tokens - d.num_computed_tokens) for d in active]
                ids, positions, meta, rows = self.runner.prepare(batch)  # reorders `batch`; rows follow it
                order = [s.seq for s in batch]
                tokens, carry = self._forward(order, ids, positions, meta, rows)
                active = []
                for j, (d, tok) in enumerate(zip(order, tokens, strict=True)):
                    i, k = want[id(d)]
                    self._computed(d, first=not out[i])
                    out[i].append(tok)
                    if len(out[i]) < k:
                        self._feed(d, tok, carry, j)  # fed next round, at the next position
                        active.append(d)
                    else:
                        self._done(d, out[i])
        return out

    def _catch_up(self, seq: Sequence, k: int) -> Any:
        """The sequence's draft state ready to feed what the draft cache lacks (None: nothing to feed,
        or no room for it)."""
        raise NotImplementedError

    def _forward(self, order: list[Any], ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 rows: list[int]) -> tuple[list[int], Any]:
        """One forward over the states' chunks (in `order`): the next token of each, and what `_feed`
        needs of this forward."""
        raise NotImplementedError

    def _computed(self, d: Any, first: bool) -> None:
        """The forward computed `d`'s chunk (`first`: its catch-up chunk)."""
        d.num_computed_tokens = d.num_tokens

    def _feed(self, d: Any, token: int, carry: Any, row: int) -> None:
        d.all_token_ids.append(token)

    def _done(self, d: Any, drafts: list[int]) -> None:
        """`d`'s proposal is complete: keep in the draft cache only what stays valid."""
        raise NotImplementedError

    def _cover(self, d: Any, slots: int) -> bool:
        """Give `d` blocks for `slots` cache slots in all; False (and nothing taken) when too few are free."""
        need = -(-slots // self.block_size) - len(d.block_table)
        if need > len(self.free):
            return False
        for _ in range(need):
            d.block_table.append(self.free.pop())
        return True

    def release(self, seq: Sequence) -> None:
        st = seq.spec
        if st is None or st.draft_cache is None:
            return
        self.free.extend(reversed(st.draft_cache.block_table))
        st.draft_cache = None


class NgramDrafter(Drafter):
    def draft_tokens(self, seq: Sequence, k: int) -> list[int]:
        return ngram_draft(seq.all_token_ids, k)


def verify(draft: list[int], targets: list[int]) -> list[int]:
    """The tokens a verification step emits: the drafts the model agrees with, then the model's own
    token (len(targets) == len(draft) + 1: the model's argmax after the fed token and each draft)."""
    out = []
    for d, t in zip(draft, targets, strict=False):
        if d != t:
            out.append(t)
            return out
        out.append(d)
    out.append(targets[len(draft)])
    return out
