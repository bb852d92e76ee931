"""A step's KV writes, layer by layer: each layer's pages of every job are submitted once the layer
has been computed (`LayerEvents`: without draining the device) and the writes proceed while the next
layer computes; `finish` waits for all of them.

Rank 0 of a prefill worker runs it for the jobs its scheduler planned (`prefill_worker/kv_sender.py`);
each other tensor-parallel rank runs it for the same jobs on its own heads, into the same rank of the
decode worker (`worker/kv_rank.py`).
"""

from __future__ import annotations

import torch

from kvtransfer.writer import KVWriter, TransferJob
from worker.layer_events import LayerEvents, event_factory


class LayerWrites:
    def __init__(self, writer: KVWriter, device: torch.device):
        self.writer = writer
        self.layers = LayerEvents(event_factory(device))
        self.jobs: list[TransferJob] = []

    def start(self, jobs: list[TransferJob]) -> None:
        self.jobs = jobs

    def after_layer(self, layer: int) -> None:
        if not self.jobs:
            return
        jobs, writer = self.jobs, self.writer

        def submit() -> None:  # on the sender thread, once the layer's K/V are in memory
            for job in jobs:
                writer.submit_layer(job, layer)

        self.layers.layer_done(submit)

    def finish(self) -> list[TransferJob]:
        """Waits until every write of the step completed or failed; returns the step's jobs."""
        jobs, self.jobs = self.jobs, []
        if jobs:
            self.layers.drain()  # every layer's writes submitted (happens-before: the queue's join)
        self.writer.wait(jobs)
        return jobs

    def close(self) -> None:
        self.layers.close()
