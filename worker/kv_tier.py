"""The cluster-wide KV tier behind a worker's own prefix cache (Mooncake Store).

Publishing: every full block the engine computed (a prompt's, when it is done; the output's,
when the request ends) is pinned by the engine, published from the KV buffer under a content
key, and unpinned. The queue is bounded in blocks: beyond it blocks are dropped (unpinned at
once), never waited for. Fetching: before a prompt is computed, the blocks past the local cache
hit that the store holds are read straight into the prompt's own blocks; only the rest is
computed. A block that did not arrive whole is never used (the request computes it).

Keys: `splitfire/<fingerprint>/<chained block hash>`. The block hash is the local prefix
cache's (tenant-rooted, chained over every token before it: content-addressed, never
rewritten); the fingerprint covers the weights, dtype, block size and KV layout, so two models
or layouts never read each other's blocks.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from concurrent.futures import ThreadPoolExecutor

from common.block_hash import block_hashes
from engine.async_engine import AsyncEngine
from engine.loading.checkpoint import model_fingerprint
from kvtransfer.store import KVStore
from worker.metrics import WorkerMetrics

log = logging.getLogger("splitfire.worker")

MAX_PENDING_BLOCKS = 4096


class KVTier:
    def __init__(self, store: KVStore, aengine: AsyncEngine, metrics: WorkerMetrics,
                 max_pending_blocks: int = MAX_PENDING_BLOCKS):
        engine = aengine.llm
        layout = engine.kv.layout
        # Quantized weights, and int8-rounded activations, compute different KV than float ones from
        # the same files: workers share blocks only when they compute them the same way.
        ident = (f"{model_fingerprint(engine.model_dir)}/{engine.config.quantization or 'native'}/"
                 f"{engine.config.cpu_activations}/{layout.dtype}/{layout.block_size}/{layout.num_layers}x"
                 f"{layout.num_kv_heads}x{layout.head_dim}")
        self.prefix = f"splitfire/{hashlib.sha256(ident.encode()).hexdigest()[:24]}/"
        self.store = store
        self.aengine = aengine
        self.metrics = metrics
        self.block_size = layout.block_size
        self._page = layout.page_bytes
        self._base = engine.kv.base_address
        self._layers = layout.num_layers
        self._num_blocks = layout.num_blocks
        self.max_pending = max_pending_blocks
        self.pending = 0
        self._queue: asyncio.Queue[tuple[list[bytes], list[int]]] = asyncio.Queue()
        # One thread each, so a large publish never delays a request's fetch (TCP waits spin a
        # core each: more threads would compete with the model on small hosts).
        self._fetcher = ThreadPoolExecutor(1, thread_name_prefix="kv-fetch")
        self._publisher = ThreadPoolExecutor(1, thread_name_prefix="kv-publish")
        self._task: asyncio.Task | None = None
        self._fills: set[asyncio.Task] = set()
        store.register(engine.kv.base_address, engine.kv.nbytes)
        engine.kv_tier = True
        aengine.on_publish = self.on_publish
        aengine.on_fetch = self.on_fetch

    def keys(self, hashes: list[bytes]) -> list[str]:
        return [self.prefix + h.hex() for h in hashes]

    def _ranges(self, blocks: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        """Each block's page in every layer: where its object's bytes come from or go to."""
        stride = self._num_blocks * self._page
        ptrs = [[self._base + b * self._page + layer * stride for layer in range(self._layers)] for b in blocks]
        return ptrs, [[self._page] * self._layers for _ in blocks]

    # -- fetching (the request path) ----------------------------------------------------

    async def held(self, scope: str, token_ids: list[int]) -> int:
        """How many reusable blocks of a prompt past the local cache's hit the store holds: a
        cheap question (one hash pass, one lookup RPC) to ask before taking the fetch path."""
        last = (len(token_ids) - 1) // self.block_size
        hashes = block_hashes(scope, token_ids[: last * self.block_size], self.block_size)
        local = await self.aengine.cached_prefix_blocks(hashes)
        if local >= last:
            return 0
        return await asyncio.get_running_loop().run_in_executor(self._fetcher, self.store.present,
                                                                self.keys(hashes[local:]))

    async def fill(self, request_id: str) -> int:
        """Read the blocks of a reserved prompt past its local hit that the store holds, into the
        prompt's own blocks. Returns the prompt tokens cached now (local + store)."""
        aeng = self.aengine
        hashes, blocks = await aeng.fill_plan(request_id)
        n = 0
        if hashes:
            n = await asyncio.get_running_loop().run_in_executor(self._fetcher, self._fetch, self.keys(hashes), blocks)
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

    def _fetch(self, keys: list[str], blocks: list[int]) -> int:
        try:
            n = self.store.present(keys)
            if n == 0:
                return 0
            ptrs, sizes = self._ranges(blocks[:n])
            return self.store.get(keys[:n], ptrs, sizes)
        except Exception:  # a cache: the request computes what did not arrive
            log.exception("event=kv_fetch_failed blocks=%d", len(keys))
            self.metrics.kv_store_blocks.labels(role=self.metrics.role, op="fetch_failed").inc(len(keys))
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
                ptrs, sizes = self._ranges(blocks)
                done = await loop.run_in_executor(self._publisher, self.store.put, self.keys(hashes), ptrs, sizes)
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
        await asyncio.to_thread(self.store.close)
