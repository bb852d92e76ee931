"""An exact prefix index built from the workers' KV events, the same in every router replica.

Each worker publishes what its prefix cache stores and evicts on a Redis stream (`worker/kv/events.py`).
Every replica reads every worker's stream and keeps, per worker, the set of block hashes its cache
holds: the same events in the same order give every replica the same index, so a conversation's next
turn sent to another replica (or to a replica that just restarted) is placed where its prefix is.

- **Bootstrap**: for a worker not yet synced, the replica notes the stream's last entry, asks the
  worker for its whole cache (`KVBlocks`: hashes and the number of the last event they include), then
  applies the entries after the noted one, skipping events the snapshot already holds.
- **Gaps**: events are numbered one by one per worker. An entry that starts past the next expected
  number (the replica fell behind the stream's trim, or Redis lost an entry), or a new epoch (the worker
  restarted), puts that worker back to bootstrap: no replica routes on a stale view longer than one
  resync. While a worker is not synced, placement falls back to the approximate per-replica index
  (`prefix_index.PrefixIndex`), as it does for workers that publish no events.
- A worker that leaves the registry takes its blocks out of the index.

The index answers the `PrefixIndex` questions (`cached_tokens`, `matched_blocks`) and forwards
`insert` / `clear` to the approximate index it falls back on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from common.block_hash import KV_EVENT_BYTES
from router.backends.worker_client import WorkerClient
from router.core.endpoints import Endpoint, EndpointRegistry
from router.core.prefix_index import _FLEET, STORE_HIT_COST, PrefixIndex

log = logging.getLogger("splitfire.router")

OP_BYTES = KV_EVENT_BYTES


@dataclass
class WorkerView:
    stream: str = ""
    epoch: str = ""
    seq: int = 0
    last_id: bytes = b"0-0"
    blocks: set[bytes] = field(default_factory=set)
    synced: bool = False
    retry_at: float = 0.0  # a worker without events is asked again after this


class ExactPrefixIndex:
    def __init__(self, fallback: PrefixIndex, registry: EndpointRegistry, workers: WorkerClient, redis: Any,
                 timeout_s: float = 2.0, block_ms: int = 200):
        self.fallback = fallback
        self.registry = registry
        self.workers = workers
        self.redis = redis
        self.timeout_s = timeout_s
        self.block_ms = block_ms
        self.views: dict[str, WorkerView] = {}  # by endpoint address
        self.resyncs = 0
        self.gaps = 0
        self.events = 0

    # -- PrefixIndex ----------------------------------------------------------------------

    @property
    def shared_store(self) -> bool:
        return self.fallback.shared_store

    def matched_blocks(self, endpoint: str, hashes: list[bytes]) -> int:
        v = self.views.get(endpoint)
        if v is None or not v.synced:
            return self.fallback.matched_blocks(endpoint, hashes)
        n = 0
        for h in hashes:
            if h not in v.blocks:
                break
            n += 1
        return n

    def cached_tokens(self, endpoint: str, hashes: list[bytes], max_blocks: int, block_size: int) -> int:
        local = min(self.matched_blocks(endpoint, hashes), max_blocks)
        if not self.fallback.shared_store:
            return local * block_size
        fleet = min(self.fallback.matched_blocks(_FLEET, hashes), max_blocks)
        return int((local + (1 - STORE_HIT_COST) * max(fleet - local, 0)) * block_size)

    def insert(self, endpoint: str, hashes: list[bytes]) -> None:
        self.fallback.insert(endpoint, hashes)

    def clear(self) -> None:
        self.fallback.clear()  # (the exact views follow the workers' own eviction events)

    # -- events -----------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis or a worker down: keep the fallback, try again
                log.warning("event=kv_index_error error=%r", e)
                await asyncio.sleep(1.0)

    async def step(self) -> None:
        """One round: follow the registry, bootstrap who needs it, apply what the streams hold."""
        live = {ep.address: ep for ep in self.registry.all() if ep.role != "openai" and ep.healthy}
        for address in list(self.views):
            if address not in {ep.address for ep in self.registry.all()}:
                del self.views[address]  # left the fleet: its blocks leave the index
        for address, ep in live.items():
            v = self.views.setdefault(address, WorkerView())
            if not v.synced:
                await self._bootstrap(ep, v)
        streams = {v.stream: v.last_id for v in self.views.values() if v.synced and v.stream}
        if not streams:
            await asyncio.sleep(self.block_ms / 1000)
            return
        by_stream = {v.stream: (a, v) for a, v in self.views.items() if v.synced}
        replies = await self.redis.xread(streams, count=1000, block=self.block_ms)
        for key, entries in replies or []:
            name = key.decode() if isinstance(key, bytes) else key
            address, v = by_stream[name]
            for entry_id, fields in entries:
                v.last_id = entry_id
                if not self._apply(address, v, fields):
                    break  # a gap: resync next round

    async def _bootstrap(self, ep: Endpoint, v: WorkerView) -> None:
        if v.retry_at > time.monotonic():
            return
        if not v.stream:  # where its events go (the snapshot says)
            first = await self.workers.kv_blocks(ep, self.timeout_s)
            if first is None:  # it publishes no events: the fallback index serves it; ask again later
                v.retry_at = time.monotonic() + 30.0
                return
            v.stream = first.stream
        # The stream's position first, then the snapshot: every entry up to that position holds events the
        # snapshot already includes; later entries are applied past the snapshot's number.
        last = await self.redis.xrevrange(v.stream, count=1)
        snap = await self.workers.kv_blocks(ep, self.timeout_s)
        if snap is None:
            v.stream, v.retry_at = "", time.monotonic() + 30.0
            return
        v.stream, v.epoch, v.seq, v.blocks = snap.stream, snap.epoch, snap.seq, set(snap.hashes)
        v.last_id = last[0][0] if last else b"0-0"
        v.synced = True
        self.resyncs += 1
        log.info("event=kv_index_synced address=%s blocks=%d seq=%d", ep.address, len(v.blocks), v.seq)

    def _apply(self, address: str, v: WorkerView, fields: dict) -> bool:
        epoch = _text(fields[b"epoch"])
        seq, n, ops = int(fields[b"seq"]), int(fields[b"n"]), fields[b"ops"]
        if epoch != v.epoch:
            log.info("event=kv_index_resync address=%s reason=new_epoch", address)
            v.synced = False
            return False
        first = seq - n + 1
        if first > v.seq + 1:
            self.gaps += 1
            log.info("event=kv_index_resync address=%s reason=gap expected=%d got=%d", address, v.seq + 1, first)
            v.synced = False
            return False
        for i in range(max(v.seq + 1 - first, 0), n):
            op, h = ops[i * OP_BYTES : i * OP_BYTES + 1], ops[i * OP_BYTES + 1 : (i + 1) * OP_BYTES]
            if op == b"+":
                v.blocks.add(h)
            else:
                v.blocks.discard(h)
            self.events += 1
        v.seq = max(v.seq, seq)
        return True


class KVIndexCollector:
    """The exact index on /metrics: per worker whether it is synced and the blocks it holds; events
    applied, resyncs and gaps since the start."""

    def __init__(self, index: ExactPrefixIndex):
        self.index = index

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        synced = GaugeMetricFamily("splitfire_router_kv_index_synced", "1 while the exact index follows this "
                                   "worker's KV events (0: the approximate index places for it)", labels=["endpoint"])
        blocks = GaugeMetricFamily("splitfire_router_kv_index_blocks", "Blocks the worker's prefix cache holds, "
                                   "by its KV events", labels=["endpoint"])
        for address, v in self.index.views.items():
            synced.add_metric([address], 1 if v.synced else 0)
            if v.synced:
                blocks.add_metric([address], len(v.blocks))
        yield synced
        yield blocks
        yield CounterMetricFamily("splitfire_router_kv_index_events", "KV events applied", value=self.index.events)
        yield CounterMetricFamily("splitfire_router_kv_index_resyncs", "Snapshots read (start, gaps, restarts)",
                                  value=self.index.resyncs)
        yield CounterMetricFamily("splitfire_router_kv_index_gaps", "Numbering gaps found in a worker's events",
                                  value=self.index.gaps)


def _text(b: Any) -> str:
    return b.decode() if isinstance(b, bytes) else str(b)
