"""The `Worker` gRPC service every role serves (Abort, Health, Stats), and the shared context."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from common.errors import RequestError
from engine.async_engine import AsyncEngine
from engine.loading.lora_adapters import read_adapter
from protos import splitfire_pb2 as pb
from protos import splitfire_pb2_grpc as pb_grpc
from worker.config import WorkerConfig
from worker.metrics import WorkerMetrics

log = logging.getLogger("splitfire.worker")


@dataclass
class WorkerContext:
    config: WorkerConfig
    engine: AsyncEngine
    metrics: WorkerMetrics
    model_name: str
    draining: bool = False
    inflight: set[str] = field(default_factory=set)  # request ids with an open RPC
    kv_tier: Any = None  # worker.kv_tier.KVTier when a cluster-wide KV store is configured
    stream_port: int = 0  # the HTTP port serving Decode.Generate as frames (0: gRPC only)
    adapters: list[str] = field(default_factory=list)  # LoRA adapters taking requests (as of the last change)
    kv_events: Any = None  # worker.kv_events.KVEventPublisher with --redis-url
    host: Any = None  # worker.model_host.ModelHost when the worker serves several base models

    def contexts(self) -> list[WorkerContext]:
        """The context of every base model resident now (this one alone unless the worker hosts several)."""
        if self.host is None:
            return [self]
        return [m.resident.ctx for m in self.host.models.values() if m.resident is not None]

    async def refuse_if_draining(self, context: grpc.aio.ServicerContext) -> None:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining (shutting down)")


class WorkerService(pb_grpc.WorkerServicer):
    def __init__(self, ctx: WorkerContext, extra_abort=None, writes_settled=None):
        self.ctx = ctx
        self.extra_abort = extra_abort  # role-specific cleanup, e.g. cancel the remote prefill
        # Prefill role: engine-thread check that no KV write of a request can still land.
        self.writes_settled = writes_settled

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        rid = request.request_id
        settled = self.writes_settled

        def abort(engine) -> tuple[bool, bool]:  # between steps: no write is in flight now
            found = engine.abort(rid)
            return found, settled(rid) if settled is not None else False

        found, writes_settled = False, False
        for ctx in self.ctx.contexts():  # (a request id lives in one engine; a worker hosting several asks each)
            f, w = await ctx.engine.call(abort)
            found, writes_settled = found or f, writes_settled or w
        if self.extra_abort is not None:
            found = await self.extra_abort(rid) or found
        log.info("event=abort rid=%s found=%s writes_settled=%s", rid, found, writes_settled)
        return pb.AbortResponse(found=found, writes_settled=writes_settled)

    async def ResetPrefixCache(self, request: pb.ResetPrefixCacheRequest, context) -> pb.ResetPrefixCacheResponse:
        freed = unshared = 0
        for ctx in self.ctx.contexts():
            f, u = await ctx.engine.reset_prefix_cache()
            freed, unshared = freed + f, unshared + u
        log.info("event=prefix_cache_reset freed=%d unshared=%d", freed, unshared)
        return pb.ResetPrefixCacheResponse(blocks_dropped=freed, blocks_unshared=unshared)

    async def KVBlocks(self, request: pb.KVBlocksRequest, context) -> pb.KVBlocksResponse:
        pub = self.ctx.kv_events
        if pub is None:
            return pb.KVBlocksResponse(enabled=False)
        seq, hashes = await self.ctx.engine.kv_snapshot()
        return pb.KVBlocksResponse(seq=seq, hashes=b"".join(hashes), epoch=pub.epoch, enabled=True, stream=pub.key)

    async def Health(self, request: pb.HealthRequest, context) -> pb.HealthResponse:
        eng = self.ctx.engine.llm
        return pb.HealthResponse(
            status="draining" if self.ctx.draining else "serving",
            role=self.ctx.config.role,
            model=self.ctx.model_name,
            block_size=eng.config.block_size,
            max_model_len=eng.max_model_len,
            stream_port=self.ctx.stream_port, stream_mux=bool(self.ctx.stream_port), adapters=self.ctx.adapters,
            models=self.ctx.host.names() if self.ctx.host is not None else [],
            resident=self.ctx.host.resident() if self.ctx.host is not None else [],
        )

    async def LoadAdapter(self, request: pb.LoadAdapterRequest, context) -> pb.LoadAdapterResponse:
        """A LoRA adapter from under a --lora-root, read off the engine thread and placed between steps;
        anything wrong is INVALID_ARGUMENT naming it, and nothing already loaded is touched."""
        ctx, t0 = self.ctx, time.perf_counter()
        llm = ctx.engine.llm
        try:
            if llm.loras is None:
                raise RequestError("this worker serves no LoRA adapters: start it with --enable-lora or "
                                   "--lora-modules")
            llm.loras.check_name(request.name)
            path = ctx.config.lora_path(request.path)
            adapter = await asyncio.to_thread(read_adapter, request.name, path, llm.model, llm.config.max_lora_rank)
            await ctx.engine.call(lambda e: e.install_adapter(adapter))
        except (RequestError, ValueError) as e:
            log.warning("event=lora_load_refused name=%s path=%s error=%s", request.name, request.path, e)
            ctx.metrics.adapter_loads.labels(role=ctx.config.role, op="refused").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        ctx.adapters = await ctx.engine.call(lambda e: e.adapters)
        seconds = time.perf_counter() - t0
        m = ctx.metrics
        m.adapter_loads.labels(role=ctx.config.role, op="ok").inc()
        m.adapter_load_seconds.labels(**m.labels).observe(seconds)
        m.adapters_resident.labels(**m.labels).set(len(ctx.adapters))
        return pb.LoadAdapterResponse(rank=adapter.rank, load_seconds=seconds)

    async def UnloadAdapter(self, request: pb.UnloadAdapterRequest, context) -> pb.UnloadAdapterResponse:
        try:
            gone = await self.ctx.engine.call(lambda e: e.unload_adapter(request.name))
        except RequestError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        self.ctx.adapters = await self.ctx.engine.call(lambda e: e.adapters)
        m = self.ctx.metrics
        m.adapter_loads.labels(role=self.ctx.config.role, op="unloaded").inc()
        m.adapters_resident.labels(**m.labels).set(len(self.ctx.adapters))
        return pb.UnloadAdapterResponse(pending=not gone)

    async def Stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        # A worker hosting several models reports their sum (they share its cores).
        parts = [_stats(ctx) for ctx in self.ctx.contexts()]
        if len(parts) == 1:
            return parts[0]
        out = pb.StatsResponse()
        for f in out.DESCRIPTOR.fields:
            setattr(out, f.name, sum(getattr(p, f.name) for p in parts))
        return out


def _stats(ctx: WorkerContext) -> pb.StatsResponse:
    st = ctx.engine.stats  # as of the last step: no waiting behind the one running now
    b = st.blocks
    return pb.StatsResponse(
        prompt_tokens_in_flight=st.prompt_tokens_in_flight, running=st.running, waiting=st.waiting,
        kv_blocks_total=b.total, kv_blocks_used=b.used, kv_blocks_free=b.free, kv_blocks_cached=b.cached,
        kv_tokens_held=st.kv_tokens_held, prefix_query_tokens=b.prefix_query_tokens,
        prefix_hit_tokens=b.prefix_hit_tokens, decode_tokens_remaining=st.decode_tokens_remaining,
        reserved=st.reserved, store_hit_tokens=st.store_hit_tokens,
    )
