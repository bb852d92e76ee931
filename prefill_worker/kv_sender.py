"""Streams each layer's freshly computed K/V pages to the decode worker while the next layer runs.

Plugs into the engine as its `StepObserver`. For a request whose chunk runs this step,
the blocks to send are those from the first block the decode worker lacks (or the
first not yet sent) up to the last block the chunk completes; the prompt's final,
partly filled block goes with the last chunk. Every block is sent exactly once.

Tensor parallel: every rank holds its own heads of each page and writes them where the plan's routes
say (`worker/kv/routes.py`): rank r into rank r of a decode worker split the same way (whole pages),
or head slices into the decode ranks that hold those heads when the two are split differently. Rank 0
plans the step's blocks and sends them to the other ranks with the step's inputs (`RankGroup.attach`);
each runs its own routes on its own pages (`worker/kv/rank.py`) and answers with what it wrote once
its writes are done.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.batch.scheduler import ScheduledSeq
from engine.ranks import RankGroup
from kvtransfer.descriptors import coalesce, landing_runs
from kvtransfer.writer import KVWriter, TransferJob
from worker.kv.layer_writes import LayerWrites
from worker.kv.rank import JobSpec, rank_jobs
from worker.kv.routes import KVSplit, Route
from worker.kv.staging import KVStaging


@dataclass
class TransferPlan:
    request_id: str
    dests: list[tuple[str, int, int]]  # the decode worker's ranks: Mooncake segment, KV base address, layers held
    dims: tuple[int, int]  # their KV regions' blocks and page bytes (every rank's alike)
    first_block: int  # prompt block index of dst_blocks[0]
    dst_blocks: list[int]
    routes: list[Route]  # which of this worker's ranks writes which heads into which decode rank
    landing_blocks: list[int] | None = None  # spare decode blocks for landable routes, one per dst_blocks entry
    next_block: int = 0  # first prompt block not yet completely sent
    bytes: int = 0
    entries: int = 0
    started: float = 0.0
    finished: float = 0.0
    compute_s: float = 0.0
    forward_started: float = 0.0  # perf_counter() at the start of its first step that sent blocks (traces)
    forward_ended: float = 0.0  # ... and at the end of its last
    landing_runs: dict[int, tuple[int, int]] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.next_block = self.first_block
        self.landing_runs = landing_runs(self.landing_blocks) if self.landing_blocks else None

    @property
    def landed(self) -> bool:
        """Some of its heads go through landing blocks."""
        return self.landing_runs is not None and any(r.part.landable for r in self.routes)

    @property
    def transfer_s(self) -> float:
        return max(self.finished - self.started, 0.0)


class LayerwiseKVSender:
    def __init__(self, writer: KVWriter, split: KVSplit, device: torch.device, ranks: RankGroup | None = None,
                 staging: KVStaging | None = None):
        self.writes = LayerWrites(writer, device, staging)
        self.split = split  # how this worker's pages are split over its ranks
        self.block_size = split.block_size
        self.ranks = ranks  # the other tensor-parallel ranks, which send their own heads
        self.plans: dict[str, TransferPlan] = {}  # engine thread only
        # Requests with a write that failed or timed out: Mooncake may still complete it later, so
        # their destination blocks are never declared settled (the decode side quarantines them).
        self.unsettled: dict[str, float] = {}
        self._jobs: list[tuple[TransferPlan, list[TransferJob], int]] = []
        self._t0 = 0.0

    def add_plan(self, plan: TransferPlan) -> None:
        self.plans[plan.request_id] = plan

    def remove_plan(self, request_id: str) -> TransferPlan | None:
        return self.plans.pop(request_id, None)

    def settled(self, request_id: str, keep_s: float = 600.0) -> bool:
        """Between steps (engine thread): True when no write of `request_id` can still land."""
        now = time.monotonic()
        for rid, at in list(self.unsettled.items()):
            if now - at > keep_s:
                del self.unsettled[rid]
        return request_id not in self.unsettled

    def before_forward(self, batch: list[ScheduledSeq]) -> None:
        self._jobs = []
        specs: list[JobSpec] = []
        self._t0 = time.perf_counter()
        bs = self.block_size
        for s in batch:
            plan = self.plans.get(s.seq.request_id)
            if plan is None:
                continue
            end = s.seq.num_computed_tokens + s.num_tokens
            last_chunk = end >= s.seq.num_prompt_tokens
            lo, hi = plan.next_block, (-(-end // bs) if last_chunk else end // bs)
            if hi <= lo:
                continue
            src, at = s.seq.block_table[lo:hi], slice(lo - plan.first_block, hi - plan.first_block)
            landing = coalesce(src, plan.landing_blocks[at]) if plan.landed and plan.landing_blocks else None
            spec = JobSpec(plan.request_id, coalesce(src, plan.dst_blocks[at]), plan.dests, plan.dims, plan.routes,
                           landing, plan.landing_runs if landing is not None else None)
            self._jobs.append((plan, rank_jobs(spec, 0), hi))
            specs.append(spec)
        self.writes.start([job for _, jobs, _ in self._jobs for job in jobs])
        if self.ranks is not None and specs:
            self.ranks.attach(specs)

    def after_layer(self, layer: int) -> None:
        self.writes.after_layer(layer)

    def after_forward(self) -> dict[str, str]:
        compute_s = time.perf_counter() - self._t0
        self.writes.finish()
        # The other ranks' writes of the same jobs: (bytes, entries, error) per request each.
        answers: list[dict[str, tuple[int, int, str | None]]] = self.ranks.collect() if self.ranks is not None else []
        errors: dict[str, str] = {}
        now = time.perf_counter()
        for plan, jobs, full_blocks in self._jobs:
            plan.compute_s += compute_s
            plan.forward_started = plan.forward_started or self._t0
            plan.forward_ended = now
            error = None
            for job in jobs:
                plan.bytes += job.bytes
                plan.entries += job.entries
                if job.started and (not plan.started or job.started < plan.started):
                    plan.started = job.started
                plan.finished = max(plan.finished, job.finished)
                error = error or job.error
            plan.next_block = max(plan.next_block, full_blocks)
            for rank, answer in enumerate(answers, start=1):
                nbytes, entries, rank_error = answer.get(plan.request_id, (0, 0, None))
                plan.bytes += nbytes
                plan.entries += entries
                if rank_error is not None and error is None:
                    error = f"rank {rank}: {rank_error}"
            if error is not None:
                errors[plan.request_id] = error
                self.unsettled[plan.request_id] = time.monotonic()
        self._jobs = []
        return errors
