"""The cluster-wide KV tier behind a worker's own prefix cache (Mooncake Store).

Publishing: every full block the engine computed (a prompt's, when it is done; the output's,
when the request ends) is pinned by the engine, published from the KV buffer under a content
key, and unpinned. The queue is bounded in blocks: beyond it blocks are dropped (unpinned at
once), never waited for. Fetching: before a prompt is computed, the blocks past the local cache
hit that the store holds are read straight into the prompt's own blocks; only the rest is
computed. A block that did not arrive whole is never used (the request computes it).

Keys: `splitfire/<fingerprint>/<part><chained block hash>`. The block hash is the local prefix
cache's (tenant-rooted, chained over every token before it: content-addressed, never
rewritten); the fingerprint covers the weights, dtype, block size and KV layout (and the
model-parallel split), so two models or layouts never read each other's blocks. A worker split
over several ranks publishes and fetches each rank's part of a block on that rank
(`worker/kv/tier_ranks.py`); `<part>` is empty on one rank.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from common.block_hash import block_hashes
from engine.async_engine import AsyncEngine
from engine.compute_threads import releasing
from engine.loading.checkpoint import model_fingerprint
from kvtransfer.store import KVStore
from worker.kv.routes import KVSplit
from worker.kv.tier_ranks import AgentAddress, RemotePages, StorePages, part_names, publishers
from worker.metrics import WorkerMetrics

log = logging.getLogger("splitfire.worker")

MAX_PENDING_BLOCKS = 4096


class KVTier:
    def __init__(self, store: KVStore, aengine: AsyncEngine, metrics: WorkerMetrics,
                 max_pending_blocks: int = MAX_PENDING_BLOCKS, agents: list[AgentAddress] | None = None):
        """`agents`: the other model-parallel ranks' store agents, in rank order (none on one rank)."""
        engine = aengine.llm
        layout = engine.kv.layout
        ranks = engine.ranks
        tp, pp = (ranks.tp, ranks.pp) if ranks is not None else (1, 1)
        # Quantized weights, and int8-rounded activations, compute different KV than float ones from
        # the same files: workers share blocks only when they compute them the same way.
        ident = (f"{model_fingerprint(engine.model_dir)}/{engine.config.quantization or 'native'}/"
                 f"{engine.config.cpu_activations}/{layout.dtype}/{layout.block_size}/{layout.num_layers}x"
                 f"{layout.num_kv_heads}x{layout.head_dim}" + (f"/tp{tp}pp{pp}" if tp * pp > 1 else ""))
        self.prefix = f"splitfire/{hashlib.sha256(ident.encode()).hexdigest()[:24]}/"
        cfg = engine.model_config
        split = KVSplit(cfg, tp, layout.block_size, layout.element_size)
        stages = list(ranks.stages) if ranks is not None and pp > 1 else [range(cfg.num_layers)]
        heads = split.head_ranges(tp)
        self.parts = part_names(stages, heads, cfg.num_layers, 1 if cfg.mla is not None else cfg.num_kv_heads)
        self.publishes = publishers(self.parts)
        if len(agents or []) != tp * pp - 1:
            raise ValueError(f"the KV tier of a worker over {tp * pp} ranks needs a store agent on each other rank, "
                             f"got {len(agents or [])}")
        self.remote = [RemotePages(a) for a in agents or []]
        self.store = store
        self.aengine = aengine
        self.metrics = metrics
        self.block_size = layout.block_size
        self.local = StorePages(store, engine.kv)
        self.max_pending = max_pending_blocks
        self.pending = 0
        self._queue: asyncio.Queue[tuple[list[bytes], list[int]]] = asyncio.Queue()
        # One thread each, so a large publish never delays a request's fetch (TCP waits spin a
        # core each: more threads would compete with the model on small hosts).
        self._fetcher = ThreadPoolExecutor(1, thread_name_prefix="kv-fetch")
        self._publisher = ThreadPoolExecutor(1, thread_name_prefix="kv-publish")
        self._task: asyncio.Task | None = None
        self._fills: set[asyncio.Task] = set()
        engine.handoff.kv_tier = True
        aengine.on_publish = self.on_publish
        aengine.on_fetch = self.on_fetch

    def keys(self, hashes: list[bytes], rank: int = 0) -> list[str]:
        part = self.prefix + self.parts[rank]
        return [part + h.hex() for h in hashes]

    def _present(self, hashes: list[bytes]) -> int:
        """How many leading blocks the store holds every part of (one lookup per distinct part)."""
        n = len(hashes)
        for rank, publishes in enumerate(self.publishes):
            if publishes and n:
                n = min(n, self.store.present(self.keys(hashes[:n], rank)))
        return n

    def _each_rank(self, op: str, hashes: list[bytes], blocks: list[int], only_publishers: bool) -> int:
        """`op` ("get" or "put") of the same blocks on every rank at once, each its own part: the leading
        blocks every rank moved whole."""
        sent = []
        try:
            for rank, remote in enumerate(self.remote, start=1):
                if not only_publishers or self.publishes[rank]:
                    remote.send(op, self.keys(hashes, rank), blocks)
                    sent.append(remote)
            local = self.local.get if op == "get" else self.local.put
            n = local(self.keys(hashes), blocks)
        finally:  # every request sent is answered (the connections stay in step), even after a failure here
            answers = [remote.answer(op) for remote in sent]
        return min([n, *answers])

    # -- fetching (the request path) ----------------------------------------------------

    async def held(self, scope: str, token_ids: list[int]) -> int:
        """How many reusable blocks of a prompt past the local cache's hit the store holds: a
        cheap question (one hash pass, one lookup RPC) to ask before taking the fetch path."""
        last = (len(token_ids) - 1) // self.block_size
        hashes = block_hashes(scope, token_ids[: last * self.block_size], self.block_size)
        local = await self.aengine.cached_prefix_blocks(hashes)
        if local >= last:
            return 0
        return await asyncio.get_running_loop().run_in_executor(self._fetcher, releasing(self._present), hashes[local:])

    async def fill(self, request_id: str) -> int:
        """Read the blocks of a reserved prompt past its local hit that the store holds, into the
        prompt's own blocks. Returns the prompt tokens cached now (local + store)."""
        aeng = self.aengine
        hashes, blocks = await aeng.fill_plan(request_id)
        n = 0
        if hashes:
            t0 = time.perf_counter()
            n = await asyncio.get_running_loop().run_in_executor(self._fetcher, releasing(self._fetch), hashes, blocks)
            log.info("event=kv_fetched rid=%s blocks=%d of=%d ranks=%d seconds=%.4f", request_id, n, len(hashes),
                     len(self.remote) + 1, time.perf_counter() - t0)
        self.metrics.kv_store_blocks.labels(role=self.metrics.role, op="fetched").inc(n)
        return await aeng.mark_filled(request_id, n)

    def on_fetch(self, request_ids: list[str]) -> None:
        """Prompts the scheduler admitted (in their turn, with their blocks) to be filled from the
        store: fill each, then let it compute the rest (event-loop thread)."""
        for rid in request_ids:
            task = asyncio.create_task(self._fill_and_resume(rid))
            self._fills.add(task)
            task.add_done_callback(self._fills.discard)

    async def _fill_and_resume(self, request_id: str) -> None:
        try:
            await self.fill(request_id)
        except KeyError:
            return  # aborted while it waited
        except Exception:
            log.exception("event=kv_fill_failed rid=%s", request_id)
        await self.aengine.resume_after_fill(request_id)

    def _fetch(self, hashes: list[bytes], blocks: list[int]) -> int:
        try:
            n = self._present(hashes)
            if n == 0:
                return 0
            return self._each_rank("get", hashes[:n], blocks[:n], only_publishers=False)
        except Exception:  # a cache: the request computes what did not arrive
            log.exception("event=kv_fetch_failed blocks=%d", len(hashes))
            self.metrics.kv_store_blocks.labels(role=self.metrics.role, op="fetch_failed").inc(len(hashes))
            return 0

    # -- publishing (in the background) ------------------------------------------------

    def on_publish(self, items: list[tuple[list[bytes], list[int]]]) -> None:
        """Blocks the engine pinned for publishing (event-loop thread)."""
        for hashes, blocks in items:
            if self.pending + len(blocks) > self.max_pending:
                self.metrics.kv_store_blocks.labels(role=self.metrics.role, op="dropped").inc(len(blocks))
                self.aengine.unpin_published(blocks)
                continue
            self.pending += len(blocks)
            self._queue.put_nowait((hashes, blocks))

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            hashes, blocks = await self._queue.get()
            try:
                done = await loop.run_in_executor(self._publisher, releasing(self._each_rank), "put", hashes, blocks,
                                                  True)
                self.metrics.kv_store_blocks.labels(role=self.metrics.role, op="published").inc(done)
            except Exception:
                log.exception("event=kv_publish_failed blocks=%d", len(blocks))
            finally:
                self.pending -= len(blocks)
                await self.aengine.unpin_published(blocks)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        while not self._queue.empty():  # never leave blocks pinned
            _, blocks = self._queue.get_nowait()
            await self.aengine.unpin_published(blocks)
        self._fetcher.shutdown(wait=True)
        self._publisher.shutdown(wait=True)
        for remote in self.remote:
            remote.close()
        await asyncio.to_thread(self.store.close)
