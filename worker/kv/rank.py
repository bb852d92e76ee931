"""The KV transfer and KV-store part of a worker's model-parallel ranks other than 0.

Every rank of a tensor-parallel worker holds its own heads of each KV page, in a cache of its own
(same blocks, same layout, fewer heads). For a prefill worker to fill a decode worker's cache, each
rank of the one writes its heads into the ranks of the other that hold them (`worker/kv/routes.py`:
rank r into rank r when both are split alike): so each rank registers its cache with a Mooncake
transfer engine of its own and tells rank 0 where it is (`on_ready` → `RankGroup.rank_info`; a
decode worker hands those to the prefill worker in `KVDestination.ranks`). On a prefill worker, rank
0 plans each step's writes and sends them with the step (`JobSpec`s); this rank writes its own pages
of the same blocks where its routes say, layer by layer while the next layer computes, and answers
with what it wrote (`LayerwiseKVSender.after_forward` gathers the answers).

With a cluster KV store (`--kv-store`), every rank of any role also runs a `StoreAgent` of its own
that publishes and fetches its pages when rank 0's KV tier asks (`worker/kv/tier_ranks.py`).

Run as `python -m worker.kv.rank RANK` by `engine/ranks.py` (`RankMain`), with the worker's
`TransferConfig` in SPLITFIRE_RANK_TRANSFER (prefill and decode roles) and its `StoreConfig` in
SPLITFIRE_RANK_STORE (with a KV store).
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
from kvtransfer.store import StoreConfig
from kvtransfer.transport import MooncakeTransport
from kvtransfer.writer import KVWriter, TransferJob
from worker.kv.layer_writes import LayerWrites
from worker.kv.routes import Route
from worker.kv.staging import KVStaging
from worker.kv.tier_ranks import AgentAddress, StoreAgent

ENV = "SPLITFIRE_RANK_TRANSFER"
STORE_ENV = "SPLITFIRE_RANK_STORE"


@dataclass(frozen=True)
class RankInfo:
    """What a rank (> 0) tells rank 0 once its cache exists (`RankGroup.rank_info`)."""

    segment: str  # its Mooncake transfer engine ("" without a KV transfer: colocated)
    base_address: int  # its KV cache's
    store: AgentAddress | None  # its KV-store agent (None without a store)


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
    dests: list[tuple[str, int, int]]  # the decode worker's ranks: Mooncake segment, KV base address, layers held
    dims: tuple[int, int]  # the destination's blocks and page bytes (each rank's alike)
    routes: list[Route]  # which rank writes which heads into which decode rank
    # With landing blocks (`KVDestination.landing_block_ids`): source blocks into landing blocks, coalesced,
    # and every landing block's run (`landing_runs`); landable routes write there.
    landing: list[Run] | None = None
    landing_runs: dict[int, tuple[int, int]] | None = None


def rank_jobs(spec: JobSpec, rank: int) -> list[TransferJob]:
    """The writes rank `rank` makes for `spec`: one job per route from it."""
    jobs = []
    for route in spec.routes:
        if route.src_rank == rank:
            segment, base, layers = spec.dests[route.dst_rank]
            dst = KVRegion(base, layers, *spec.dims)
            land = spec.landing is not None and route.part.landable
            jobs.append(TransferJob(spec.request_id, segment, dst, spec.landing if land else spec.runs, route.part,
                                    landing=spec.landing_runs if land else None, layers=route.layers,
                                    layer_shift=route.layer_shift))
    return jobs


def rank_main(transfer: TransferConfig | None, store: StoreConfig | None = None) -> RankMain:
    """What a worker's other ranks run: the KV transfer's part (prefill and decode roles) and the KV
    store's (with a store)."""
    env = {}
    if transfer is not None:
        env[ENV] = json.dumps(dataclasses.asdict(transfer))
    if store is not None:
        env[STORE_ENV] = json.dumps(dataclasses.asdict(store))
    return RankMain("worker.kv.rank", env)


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
    """`engine.ranks.RankExtension` of rank `rank` (> 0): its cache registered; rank 0's jobs run; its
    pages published and fetched (with a store)."""

    def __init__(self, rank: int, transfer: TransferConfig | None, store: StoreConfig | None = None):
        self.rank = rank
        self.transfer = transfer
        self.store_config = store
        self.transport: MooncakeTransport | None = None
        self.region: KVRegion | None = None
        self.writes: LayerWrites | None = None
        self.agent: StoreAgent | None = None

    def on_ready(self, kv: KVCache) -> RankInfo:
        if self.store_config is not None:
            self.agent = StoreAgent(self.store_config, kv)
        if self.transfer is not None:
            self.transport = MooncakeTransport(_own_name(self.transfer))
            self.region = register_cache(self.transport, kv)
            self.writes = LayerWrites(KVWriter(self.transport, self.region, self.transfer.max_inflight_entries),
                                      kv.buffer.device, KVStaging(kv, self.transport.register))
        return RankInfo(self.transport.segment if self.transport is not None else "", kv.base_address,
                        self.agent.address if self.agent is not None else None)

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
        if self.agent is not None:
            self.agent.close()


def main(rank: int, env: dict[str, Any]) -> None:
    transfer = TransferConfig(**json.loads(env[ENV])).validate() if ENV in env else None
    store = StoreConfig(**json.loads(env[STORE_ENV])).validate() if STORE_ENV in env else None
    follower(rank, RankKV(rank, transfer, store))


if __name__ == "__main__":
    # Run this module's code under its own name, so that what it sends rank 0 (`RankInfo`) unpickles there.
    from worker.kv.rank import main as _main

    _main(int(sys.argv[1]), dict(os.environ))
