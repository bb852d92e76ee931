"""Async scheduling: the decode step n+1 queued on the device before step n's tokens are read, so the host
schedules, prepares and commits while the device computes (`--async-scheduling`, on CUDA with decode
graphs by default).

A step of overlappable decodes (`Sequence.overlappable`, replayed from a graph) is queued (`launch`) and
its tokens read at the engine's next step, after the step after it is queued (its inputs take the unread
tokens on the device). Anything else (a prompt to admit, a block short, another kind of row, an observer)
first reads the queued step and runs in order. A sequence that stops at the step read had a row in the
next one: that row's token is dropped, and its blocks are freed once no queued step writes them.
"""

from __future__ import annotations

import time
from typing import Protocol

from engine.batch.block_manager import BlockManager
from engine.batch.model_runner import Launched, ModelRunner
from engine.batch.scheduler import ScheduledSeq, Scheduler
from engine.batch.sequence import PENDING, Sequence, Status, TokenLogprob
from engine.batch.step_times import StepTimes
from engine.outputs import RequestOutput


class Engine(Protocol):
    """What the overlap reaches of the engine (`LLMEngine`)."""

    scheduler: Scheduler
    blocks: BlockManager
    runner: ModelRunner
    times: StepTimes | None
    max_model_len: int

    def free_blocks(self, seq: Sequence) -> None: ...

    def append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None, out: RequestOutput) -> None: ...


class Overlap:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.launched: Launched | None = None  # the decode step queued on the device whose tokens are not read yet

    def launchable(self, batch: list[ScheduledSeq]) -> bool:
        return all(s.num_tokens == 1 and s.samples and not s.draft and s.seq.overlappable for s in batch) \
            and self.engine.runner.graphable(batch)

    def overlaps_next(self) -> bool:
        """Whether the next step will be a launchable batch of every running sequence, with nothing
        admitted and no preemption (each needs at most one new block): decided before scheduling it."""
        sched = self.engine.scheduler
        running = sched.running
        if sched.waiting or not running or self.engine.blocks.num_available < len(running):
            return False
        assert self.engine.runner.graphs is not None
        if len(running) > self.engine.runner.graphs.buckets[-1]:
            return False
        return all(s.overlappable and s.status == Status.RUNNING and s.num_remaining == 1 for s in running)

    def step_ahead(self) -> list[RequestOutput]:
        """Queue the next decode step behind the launched one, then read and commit the launched one."""
        times = self.engine.times
        t0 = time.perf_counter() if times is not None else 0.0
        batch = self.engine.scheduler.schedule()
        # A sequence whose pending token is its last by length needs no further row.
        batch = [s for s in batch if len(s.seq.output_token_ids) < s.seq.sampling.max_tokens
                 and s.seq.num_tokens < self.engine.max_model_len]
        if times is not None and batch:
            times.steps += 1
            times.schedule += time.perf_counter() - t0
        prev = self.launched
        assert prev is not None
        # (queued first: a sequence that stops in this read still has a row there, its blocks freed after it)
        self.launched = self.engine.runner.launch(batch, prev) if batch else None
        outputs = self.read(prev)
        if self.launched is not None:
            self.queued(self.launched)
        return outputs

    def queued(self, launched: Launched) -> None:
        """A step is queued: each of its sequences still running has its K/V computed one further and a
        pending token (an entry stopped since it was scheduled keeps neither)."""
        for s in launched.batch:
            seq = s.seq
            if seq.status == Status.RUNNING:
                self.engine.blocks.mark_computed(seq, 1)
                seq.output_token_ids.append(PENDING)
        self.launched = launched

    def read_launched(self) -> list[RequestOutput]:
        launched, self.launched = self.launched, None
        assert launched is not None
        return self.read(launched)

    def read(self, launched: Launched) -> list[RequestOutput]:
        """Wait for a queued step's tokens and commit them (a stopped sequence's is dropped); then the
        blocks of the sequences that stopped while it was queued are free."""
        try:
            tokens = launched.read()
        finally:
            for seq in launched.free_after:
                self.engine.free_blocks(seq)  # (or after the step queued since, if it has a row there too)
        t1 = time.perf_counter() if self.engine.times is not None else 0.0
        outputs: list[RequestOutput] = []
        for s, token in zip(launched.batch, tokens, strict=True):
            seq = s.seq
            if seq.status != Status.RUNNING or not seq.output_token_ids or seq.output_token_ids[-1] != PENDING:
                continue  # stopped (aborted, held) since it was queued
            seq.output_token_ids.pop()
            out = RequestOutput(seq.request_id, num_prompt_tokens=seq.num_prompt_tokens,
                                num_cached_tokens=seq.num_cached_tokens)
            self.engine.append_token(seq, token, None, out)
            outputs.append(out)
        if self.engine.times is not None:
            self.engine.times.commit += time.perf_counter() - t1
        return outputs
