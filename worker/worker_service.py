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
from engine.compute_threads import releasing
from engine.loading.lora_adapters import read_adapter
from protos import splitfire_pb2 as pb
from protos import splitfire_pb2_grpc as pb_grpc
from worker.config import WorkerConfig
from worker.metrics import WorkerMetrics
from worker.model_host import ModelUnavailable

log = logging.getLogger("splitfire.worker")


@dataclass
class WorkerContext:
    config: WorkerConfig
    engine: AsyncEngine
    metrics: WorkerMetrics
    model_name: str
    draining: bool = False
    inflight: set[str] = field(default_factory=set)  # request ids with an open RPC
    kv_tier: Any = None  # worker.kv.tier.KVTier when a cluster-wide KV store is configured
    stream_port: int = 0  # the HTTP port serving Decode.Generate as frames (0: gRPC only)
    adapters: list[str] = field(default_factory=list)  # its engine's LoRA adapters taking requests (as of the last change)
    kv_events: Any = None  # worker.kv.events.KVEventPublisher with --redis-url
    host: Any = None  # worker.model_host.ModelHost when the worker serves several base models
    tracing: Any = None  # common.tracing.Tracing when the OTEL_* environment asks for traces

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
        adapters = self.adapters()
        return pb.HealthResponse(
            status="draining" if self.ctx.draining else "serving",
            role=self.ctx.config.role,
            model=self.ctx.model_name,
            block_size=eng.config.block_size,
            max_model_len=eng.max_model_len,
            stream_port=self.ctx.stream_port, stream_mux=bool(self.ctx.stream_port), adapters=list(adapters),
            adapter_models=list(adapters.values()) if self.ctx.host is not None else [],
            models=self.ctx.host.names() if self.ctx.host is not None else [],
            resident=self.ctx.host.resident() if self.ctx.host is not None else [],
        )

    def adapters(self) -> dict[str, str]:
        """Every adapter this worker takes requests for, and the base model of each: the first model's (in
        its engine) and, hosting several, those of the models loaded on demand — resident or not (an
        evicted model's adapters are installed again when it is loaded)."""
        out = dict.fromkeys(self.ctx.adapters, self.ctx.model_name)
        if self.ctx.host is not None:
            for hm in self.ctx.host.models.values():
                if not hm.pinned:
                    out.update(dict.fromkeys(hm.adapters, hm.name))
        return out

    def _hosted(self, model: str) -> Any:
        """The on-demand model (`worker.model_host.HostedModel`) a load or unload names; None: the first."""
        if not model or model == self.ctx.model_name:
            return None
        if self.ctx.host is None:
            raise RequestError(f"model {model!r} is not served by this worker (it serves {self.ctx.model_name})")
        hm = self.ctx.host.get(model)
        return None if hm.pinned else hm

    async def _install(self, ctx: WorkerContext, name: str, path: str) -> Any:
        """Read an adapter off the engine thread and place it between steps (on `ctx`'s engine)."""
        llm = ctx.engine.llm
        if llm.loras is None:
            raise RequestError("this worker serves no LoRA adapters: start it with --enable-lora or --lora-modules")
        llm.loras.check_name(name)
        adapter = await asyncio.to_thread(releasing(read_adapter), name, path, llm.model, llm.config.max_lora_rank)
        await ctx.engine.call(lambda e: e.install_adapter(adapter))
        return adapter

    async def LoadAdapter(self, request: pb.LoadAdapterRequest, context) -> pb.LoadAdapterResponse:
        """A LoRA adapter from under a --lora-root, read off the engine thread and placed between steps;
        anything wrong is INVALID_ARGUMENT naming it, and nothing already loaded is touched. `model` names
        a model loaded on demand: it is made resident for the load (as a request would), and the adapter is
        installed again whenever that model is loaded after an eviction."""
        ctx, t0 = self.ctx, time.perf_counter()
        try:
            hosted = self._hosted(request.model)
            if request.name in self.adapters():
                raise RequestError(f"adapter {request.name!r} is already loaded on this worker")
            path = ctx.config.lora_path(request.path)
            if hosted is None:
                adapter = await self._install(ctx, request.name, path)
            else:
                hm = await ctx.host.acquire(hosted.name)
                try:
                    adapter = await self._install(hm.resident.ctx, request.name, path)
                    hm.adapters[request.name] = path
                finally:
                    ctx.host.release(hm)
        except (RequestError, ValueError) as e:
            log.warning("event=lora_load_refused name=%s path=%s model=%s error=%s", request.name, request.path,
                        request.model or ctx.model_name, e)
            ctx.metrics.adapter_loads.labels(role=ctx.config.role, op="refused").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except ModelUnavailable as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        if hosted is None:
            ctx.adapters = await ctx.engine.call(lambda e: e.adapters)
        seconds = time.perf_counter() - t0
        m = ctx.metrics
        m.adapter_loads.labels(role=ctx.config.role, op="ok").inc()
        m.adapter_load_seconds.labels(**m.labels).observe(seconds)
        m.adapters_resident.labels(**m.labels).set(len(self.adapters()))
        return pb.LoadAdapterResponse(rank=adapter.rank, load_seconds=seconds)

    async def UnloadAdapter(self, request: pb.UnloadAdapterRequest, context) -> pb.UnloadAdapterResponse:
        ctx = self.ctx
        owner = self.adapters().get(request.name)
        try:
            hosted = self._hosted(owner) if owner is not None else None
            if hosted is None:
                gone = await ctx.engine.call(lambda e: e.unload_adapter(request.name))
                ctx.adapters = await ctx.engine.call(lambda e: e.adapters)
            else:  # not installed again at the next load; requests running under it finish
                del hosted.adapters[request.name]
                resident = hosted.resident
                gone = True if resident is None else await resident.ctx.engine.call(
                    lambda e: e.unload_adapter(request.name))
        except RequestError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        m = ctx.metrics
        m.adapter_loads.labels(role=ctx.config.role, op="unloaded").inc()
        m.adapters_resident.labels(**m.labels).set(len(self.adapters()))
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
