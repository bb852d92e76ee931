"""A step's KV writes, layer by layer: each layer's pages of every job are submitted once the layer
has been computed (`LayerEvents`: without draining the device) and the writes proceed while the next
layer computes; `finish` waits for all of them.

Rank 0 of a prefill worker runs it for the jobs its scheduler planned (`prefill_worker/kv_sender.py`);
each other tensor-parallel rank runs it for the same jobs on its own heads, into the same rank of the
decode worker (`worker/kv/rank.py`).
"""

from __future__ import annotations

import torch

from kvtransfer.writer import KVWriter, TransferJob
from worker.kv.layer_events import LayerEvents, event_factory
from worker.kv.staging import KVStaging


class LayerWrites:
    def __init__(self, writer: KVWriter, device: torch.device, staging: KVStaging | None = None):
        """`staging`: head slices whose destination pages are whole are gathered there and sent as pages
        (`worker/kv/staging.py`); without it they go row by row."""
        self.writer = writer
        self.layers = LayerEvents(event_factory(device))
        self.jobs: list[TransferJob] = []
        self.staging = staging

    def start(self, jobs: list[TransferJob]) -> None:
        self.jobs = jobs
        if self.staging is not None:
            for job in jobs:
                self.staging.stage(job)

    def after_layer(self, layer: int) -> None:
        if not self.jobs:
            return
        jobs, writer, staging = self.jobs, self.writer, self.staging

        def submit() -> None:  # on the sender thread, once the layer's K/V are in memory
            if staging is not None:
                staging.gather(layer)
            for job in jobs:
                writer.submit_layer(job, layer)

        self.layers.layer_done(submit)

    def finish(self) -> list[TransferJob]:
        """Waits until every write of the step completed or failed; returns the step's jobs."""
        jobs, self.jobs = self.jobs, []
        if jobs:
            self.layers.drain()  # every layer's writes submitted (happens-before: the queue's join)
        self.writer.wait(jobs)
        if self.staging is not None:
            self.staging.reset()
        return jobs

    def close(self) -> None:
        self.layers.close()
