"""Streams each layer's freshly computed K/V pages to the decode worker while the next layer runs.

Plugs into the engine as its `StepObserver`. For a request whose chunk runs this step,
the blocks to send are those from the first block the decode worker lacks (or the
first not yet sent) up to the last block the chunk completes; the prompt's final,
partly filled block goes with the last chunk. Every block is sent exactly once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.batch.scheduler import ScheduledSeq
from kvtransfer.descriptors import KVRegion
from kvtransfer.writer import KVWriter, TransferJob, make_job
from prefill_worker.layer_events import LayerEvents, event_factory


@dataclass
class TransferPlan:
    request_id: str
    target: str  # decode worker's Mooncake segment
    dst: KVRegion
    first_block: int  # prompt block index of dst_blocks[0]
    dst_blocks: list[int]
    next_block: int = 0  # first prompt block not yet completely sent
    bytes: int = 0
    entries: int = 0
    started: float = 0.0
    finished: float = 0.0
    compute_s: float = 0.0

    def __post_init__(self) -> None:
        self.next_block = self.first_block

    @property
    def transfer_s(self) -> float:
        return max(self.finished - self.started, 0.0)


class LayerwiseKVSender:
    def __init__(self, writer: KVWriter, block_size: int, device: torch.device):
        self.writer = writer
        self.block_size = block_size
        # Each layer's writes are submitted by a sender thread once that layer's event has fired.
        self.layers = LayerEvents(event_factory(device))
        self.plans: dict[str, TransferPlan] = {}  # engine thread only
        # Requests with a write that failed or timed out: Mooncake may still complete it later, so
        # their destination blocks are never declared settled (the decode side quarantines them).
        self.unsettled: dict[str, float] = {}
        self._jobs: list[tuple[TransferPlan, TransferJob, int]] = []
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
            src = s.seq.block_table[lo:hi]
            dst = plan.dst_blocks[lo - plan.first_block : hi - plan.first_block]
            job = make_job(plan.request_id, plan.target, plan.dst, src, dst)
            self._jobs.append((plan, job, hi))

    def after_layer(self, layer: int) -> None:
        if not self._jobs:
            return
        jobs = [job for _, job, _ in self._jobs]

        def submit() -> None:  # on the sender thread, once the layer's K/V are in memory
            for job in jobs:
                self.writer.submit_layer(job, layer)

        self.layers.layer_done(submit)

    def after_forward(self) -> dict[str, str]:
        compute_s = time.perf_counter() - self._t0
        jobs = [job for _, job, _ in self._jobs]
        if jobs:
            self.layers.drain()  # every layer's writes submitted (happens-before: the queue's join)
        self.writer.wait(jobs)
        errors: dict[str, str] = {}
        for plan, job, full_blocks in self._jobs:
            plan.compute_s += compute_s
            plan.bytes += job.bytes
            plan.entries += job.entries
            if not plan.started:
                plan.started = job.started
            plan.finished = job.finished
            plan.next_block = max(plan.next_block, full_blocks)
            if job.error is not None:
                errors[plan.request_id] = job.error
                self.unsettled[plan.request_id] = time.monotonic()
        self._jobs = []
        return errors
