"""The `Worker` gRPC service every role serves (Abort, Health, Stats), and the shared context."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import grpc

from engine.async_engine import AsyncEngine
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

        found, writes_settled = await self.ctx.engine.call(abort)
        if self.extra_abort is not None:
            found = await self.extra_abort(rid) or found
        log.info("event=abort rid=%s found=%s writes_settled=%s", rid, found, writes_settled)
        return pb.AbortResponse(found=found, writes_settled=writes_settled)

    async def ResetPrefixCache(self, request: pb.ResetPrefixCacheRequest, context) -> pb.ResetPrefixCacheResponse:
        freed, unshared = await self.ctx.engine.reset_prefix_cache()
        log.info("event=prefix_cache_reset freed=%d unshared=%d", freed, unshared)
        return pb.ResetPrefixCacheResponse(blocks_dropped=freed, blocks_unshared=unshared)

    async def Health(self, request: pb.HealthRequest, context) -> pb.HealthResponse:
        eng = self.ctx.engine.llm
        return pb.HealthResponse(
            status="draining" if self.ctx.draining else "serving",
            role=self.ctx.config.role,
            model=self.ctx.model_name,
            block_size=eng.config.block_size,
            max_model_len=eng.max_model_len,
            stream_port=self.ctx.stream_port, stream_mux=bool(self.ctx.stream_port),
        )

    async def Stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        st = self.ctx.engine.stats  # as of the last step: no waiting behind the one running now
        b = st.blocks
        return pb.StatsResponse(
            prompt_tokens_in_flight=st.prompt_tokens_in_flight, running=st.running, waiting=st.waiting,
            kv_blocks_total=b.total, kv_blocks_used=b.used, kv_blocks_free=b.free, kv_blocks_cached=b.cached,
            kv_tokens_held=st.kv_tokens_held, prefix_query_tokens=b.prefix_query_tokens,
            prefix_hit_tokens=b.prefix_hit_tokens, decode_tokens_remaining=st.decode_tokens_remaining,
            reserved=st.reserved, store_hit_tokens=st.store_hit_tokens,
        )
