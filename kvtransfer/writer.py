"""Layer-by-layer KV writes for the requests of one forward pass, and waiting for them.

A job is one request's destination. After each layer is computed, its pages for every
job are submitted (one entry per coalesced run); the writes proceed on Mooncake's
threads while the next layer computes. `wait` polls with short sleeps rather than a
spin, so the transport threads keep the cores they need.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

from kvtransfer.descriptors import HeadSlice, KVRegion, Run, coalesce, landing_entries, layer_entries
from kvtransfer.errors import TransferError
from kvtransfer.transport import DONE, FAILED, PENDING, MooncakeTransport

POLL_INTERVAL_S = 0.0002


@dataclass
class TransferJob:
    request_id: str
    target: str  # the destination's Mooncake segment
    dst: KVRegion
    runs: list[Run]
    part: HeadSlice | None = None  # some heads of each page (workers split differently), else whole pages
    src: KVRegion | None = None  # where the pages are read from, if not the writer's KV region (a staging copy)
    landing: dict[int, tuple[int, int]] | None = None  # runs' destinations are landing blocks (`landing_runs`)
    layers: range | None = None  # the source layers it writes (pipeline stages); None: every layer
    layer_shift: int = 0  # destination layer = source layer + layer_shift
    pending: list[int] = field(default_factory=list)  # submitted batch ids not yet complete
    bytes: int = 0
    entries: int = 0
    started: float = 0.0
    finished: float = 0.0
    error: str | None = None

    @property
    def seconds(self) -> float:
        return max(self.finished - self.started, 0.0)


def make_job(request_id: str, target: str, dst: KVRegion, src_blocks: list[int], dst_blocks: list[int]) -> TransferJob:
    return TransferJob(request_id, target, dst, coalesce(src_blocks, dst_blocks))


class KVWriter:
    def __init__(self, engine: MooncakeTransport, src: KVRegion, max_inflight_entries: int = 1024):
        self.engine = engine
        self.src = src
        self.max_inflight = max_inflight_entries
        self._inflight: dict[str, int] = defaultdict(int)  # per target segment

    def submit_layer(self, job: TransferJob, layer: int) -> None:
        if job.error is not None or not job.runs or (job.layers is not None and layer not in job.layers):
            return
        if not job.started:
            job.started = time.perf_counter()
        try:
            src, dl = job.src or self.src, layer + job.layer_shift
            if job.landing is not None:
                assert job.part is not None
                entries = landing_entries(src, job.dst, layer, job.runs, job.part, job.landing, dl)
            else:
                entries = layer_entries(src, job.dst, layer, job.runs, job.part, dl)
            for e in entries:
                while self._inflight[job.target] >= self.max_inflight:
                    self._poll_once([job])
                job.pending.append(self.engine.submit_write(job.target, e.src, e.dst, e.length))
                self._inflight[job.target] += 1
                job.bytes += e.length
                job.entries += 1
        except (TransferError, IndexError) as e:
            job.error = f"layer {layer}: {e}"

    def _poll_once(self, jobs: list[TransferJob]) -> bool:
        """Checks every pending id once. Returns True if anything is still pending."""
        busy = False
        for job in jobs:
            still: list[int] = []
            for bid in job.pending:
                rc = self.engine.check(bid)
                if rc == PENDING:
                    still.append(bid)
                    continue
                self._inflight[job.target] -= 1
                if rc != DONE and job.error is None:
                    what = "failed" if rc == FAILED else "timed out"
                    job.error = f"KV write to {job.target} {what} (Mooncake status {rc})"
            job.pending = still
            busy = busy or bool(still)
        if busy:
            time.sleep(POLL_INTERVAL_S)
        return busy

    def wait(self, jobs: list[TransferJob]) -> None:
        """Blocks until every submitted write of `jobs` completed or failed (Mooncake's timeout bounds it)."""
        while self._poll_once(jobs):
            pass
        now = time.perf_counter()
        for job in jobs:
            if job.started:
                job.finished = now
