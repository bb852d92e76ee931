"""KV events: what this worker's prefix cache stores and evicts, published for every router replica.

Transport: one Redis stream per worker (`splitfire:kv:{advertised address}`), the Redis the worker
already registers in. Why Redis streams and not ZMQ: the routers already talk to that Redis (pins,
quotas, discovery), a stream keeps the recent past so a replica that blinks or starts late reads
what it missed instead of losing it (ZMQ PUB drops what nobody was listening to), and no extra port
has to be opened from every router to every worker.

Each entry: `epoch` (this process's stream: a restarted worker starts a new one), `seq` (the number of
the entry's last event; events are numbered one by one from 1), `n` (events in the entry) and `ops`
(b"+" or b"-" then a 16-byte block hash, per event, in order). The stream is trimmed to about
`MAXLEN` entries; a router that finds a gap in the numbers (it fell behind the trim, or an entry was
lost) re-reads the whole cache through the `KVBlocks` RPC and goes on from there.
"""

from __future__ import annotations

import asyncio
import logging
import secrets

from common.block_hash import KV_EVENT_BYTES

log = logging.getLogger("splitfire.worker")

STREAM = "splitfire:kv:{address}"
MAXLEN = 10_000


class KVEventPublisher:
    """Takes the engine's events on the loop thread (`on_kv_events`) and XADDs them, batched, in order."""

    def __init__(self, redis_url: str, address: str):
        self.redis_url = redis_url
        self.key = STREAM.format(address=address)
        self.epoch = secrets.token_hex(8)
        self.pending: list[tuple[int, bytes]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.published = 0  # events
        self.failures = 0

    def on_kv_events(self, seq: int, ops: bytes) -> None:
        self.pending.append((seq, ops))
        self._wake.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        import redis.asyncio as aioredis

        client = aioredis.from_url(self.redis_url)
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                batch, self.pending = self.pending, []
                if not batch:
                    continue
                ops = b"".join(o for _, o in batch)
                entry = {"epoch": self.epoch, "seq": batch[-1][0], "n": len(ops) // KV_EVENT_BYTES, "ops": ops}
                try:
                    await client.xadd(self.key, entry, maxlen=MAXLEN, approximate=True)  # type: ignore[arg-type]
                    self.published += entry["n"]  # type: ignore[operator]
                except Exception as e:  # Redis down: routers see the gap and resync when it is back
                    self.failures += 1
                    log.warning("event=kv_events_publish_failed key=%s events=%d error=%r", self.key, entry["n"], e)
        finally:
            await client.aclose()
