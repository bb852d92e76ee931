"""The KV transfer of a prefill or decode worker's tensor-parallel ranks other than 0.

Every rank of a tensor-parallel worker holds its own heads of each KV page, in a cache of its own
(same blocks, same layout, fewer heads). For a prefill worker to fill a decode worker's cache, each
rank of the one writes its heads into the ranks of the other that hold them (`worker/kv_routes.py`:
rank r into rank r when both are split alike): so each rank registers its cache with a Mooncake
transfer engine of its own and tells rank 0 where it is (`on_ready` → `RankGroup.rank_info`; a
decode worker hands those to the prefill worker in `KVDestination.ranks`). On a prefill worker, rank
0 plans each step's writes and sends them with the step (`JobSpec`s); this rank writes its own pages
of the same blocks where its routes say, layer by layer while the next layer computes, and answers
with what it wrote (`LayerwiseKVSender.after_forward` gathers the answers).

Run as `python -m worker.kv_rank RANK` by `engine/ranks.py` (`RankMain`), with the worker's
`TransferConfig` in SPLITFIRE_RANK_TRANSFER.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
from dataclasses import dataclass
from typing import Any

from engine.model.kv_cache import KVCache
from engine.ranks import RankMain, follower
from kvtransfer.config import TransferConfig
from kvtransfer.descriptors import KVRegion, Run
from kvtransfer.transport import MooncakeTransport
from kvtransfer.writer import KVWriter, TransferJob
from worker.kv_routes import Route
from worker.layer_writes import LayerWrites

ENV = "SPLITFIRE_RANK_TRANSFER"


def register_cache(transport: MooncakeTransport, kv: KVCache) -> KVRegion:
    """Make a KV cache writable by peers (prefill workers write into a decode worker's), page by page."""
    layout, dev = kv.layout, kv.buffer.device
    return transport.register_kv(kv.base_address, layout.num_layers, layout.num_blocks, layout.page_bytes,
                                 f"cuda:{dev.index or 0}" if dev.type == "cuda" else "cpu:0")


@dataclass(frozen=True)
class JobSpec:
    """One request's writes this step, as rank 0 planned them (the same blocks on every rank)."""

    request_id: str
    runs: list[Run]  # source and destination blocks, coalesced
    dests: list[tuple[str, int]]  # the decode worker's ranks: Mooncake segment, KV base address
    dims: tuple[int, int, int]  # the destination's layers, blocks, page bytes (each rank's alike)
    routes: list[Route]  # which rank writes which heads into which decode rank


def rank_jobs(spec: JobSpec, rank: int) -> list[TransferJob]:
    """The writes rank `rank` makes for `spec`: one job per route from it."""
    jobs = []
    for route in spec.routes:
        if route.src_rank == rank:
            segment, base = spec.dests[route.dst_rank]
            jobs.append(TransferJob(spec.request_id, segment, KVRegion(base, *spec.dims), spec.runs, route.part))
    return jobs


def rank_main(transfer: TransferConfig) -> RankMain:
    """What a prefill or decode worker's other ranks run."""
    return RankMain("worker.kv_rank", {ENV: json.dumps(dataclasses.asdict(transfer))})


def _own_name(transfer: TransferConfig) -> TransferConfig:
    """With a metadata server, a transfer engine is known by its host name (and port): a rank
    beside rank 0 on the same host needs a name of its own (P2P handshake picks its own port)."""
    if transfer.metadata == "P2PHANDSHAKE" or ":" in transfer.hostname:
        return transfer
    with socket.socket() as s:
        s.bind((transfer.hostname, 0))
        port = s.getsockname()[1]
    return dataclasses.replace(transfer, hostname=f"{transfer.hostname}:{port}")


class RankKV:
    """`engine.ranks.RankExtension` of rank `rank` (> 0): its cache registered; rank 0's jobs run."""

    def __init__(self, rank: int, transfer: TransferConfig):
        self.rank = rank
        self.transfer = transfer
        self.transport: MooncakeTransport | None = None
        self.region: KVRegion | None = None
        self.writes: LayerWrites | None = None

    def on_ready(self, kv: KVCache) -> tuple[str, int]:
        self.transport = MooncakeTransport(_own_name(self.transfer))
        self.region = register_cache(self.transport, kv)
        self.writes = LayerWrites(KVWriter(self.transport, self.region, self.transfer.max_inflight_entries),
                                  kv.buffer.device)
        return self.transport.segment, kv.base_address

    def before_forward(self, payload: list[JobSpec]) -> None:
        assert self.writes is not None
        self.writes.start([job for spec in payload for job in rank_jobs(spec, self.rank)])

    def after_layer(self, layer: int) -> None:
        assert self.writes is not None
        self.writes.after_layer(layer)

    def after_forward(self) -> dict[str, tuple[int, int, str | None]]:
        assert self.writes is not None
        out: dict[str, tuple[int, int, str | None]] = {}
        for job in self.writes.finish():
            nbytes, entries, error = out.get(job.request_id, (0, 0, None))
            out[job.request_id] = (nbytes + job.bytes, entries + job.entries, error or job.error)
        return out

    def close(self) -> None:
        if self.writes is not None:
            self.writes.close()
        if self.transport is not None:
            self.transport.close()


def main(rank: int, env: dict[str, Any]) -> None:
    transfer = TransferConfig(**json.loads(env[ENV])).validate()
    follower(rank, RankKV(rank, transfer))


if __name__ == "__main__":
    main(int(sys.argv[1]), dict(os.environ))
