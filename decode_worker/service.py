"""gRPC `Generate`: get the prompt's K/V (from a prefill worker, or computed here), then decode
in the continuous batch and stream tokens, several per message when the reader lags."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import grpc

from common.block_hash import cache_scope
from common.errors import RequestError
from common.sampling_params import SamplingParams
from common.tracing import Tracing, grpc_metadata, wall_ns
from common.tracing import end as end_span
from decode_worker.prefill_policy import PrefillDecision, decide_prefill
from kvtransfer.descriptors import KVRegion
from protos import splitfire_pb2 as pb
from protos import splitfire_pb2_grpc as pb_grpc
from protos import trailers
from worker.convert import (
    event_from_output,
    kv_dtype_name,
    logprob_from_proto,
    sampling_from_proto,
    token_ids_from_proto,
)
from worker.lifecycle import GRPC_OPTIONS
from worker.worker_service import WorkerContext

if TYPE_CHECKING:
    from engine.llm_engine import RequestOutput

log = logging.getLogger("splitfire.decode")

RESERVE_RETRY_S = 0.01
SETTLE_TIMEOUT_S = 2.0


class GenerateError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, failed_prefill: str = ""):
        super().__init__(message)
        self.code = code
        self.failed_prefill = failed_prefill  # the prefill worker that failed, if it was one

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        if not self.failed_prefill:
            return ()
        return ((trailers.FAILED_ENDPOINT, self.failed_prefill), (trailers.FAILED_ROLE, "prefill"))


class DecodeService(pb_grpc.DecodeServicer):
    def __init__(self, ctx: WorkerContext, region: KVRegion | None = None, segment: str | None = None):
        self.ctx = ctx
        self.region = region  # None in the colocated role: no remote prefill
        self.segment = segment
        # Tensor parallel: the other ranks' KV caches, which the prefill worker's other ranks fill.
        ranks = ctx.engine.llm.ranks if region is not None else None
        self.peer_ranks: list[pb.KVRank] = []
        if ranks is not None:  # (rank r holds stage r // tp's layers under pipeline parallel)
            for r, info in enumerate(ranks.rank_info, start=1):
                layers = ranks.stages[r // ranks.tp] if ranks.pp > 1 else None
                self.peer_ranks.append(pb.KVRank(segment=info.segment, base_address=info.base_address,
                                                 first_layer=layers.start if layers else 0,
                                                 num_layers=len(layers) if layers else 0))
        self._stubs: dict[str, pb_grpc.PrefillStub] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._settling: set[asyncio.Task] = set()
        self._remote_calls: dict[str, grpc.aio.UnaryUnaryCall] = {}
        # Per prefill worker: whether it sends head sections whole into landing blocks (learned from its
        # answers: `PrefillResponse.landable`); offered until an answer says it has none.
        self._lands: dict[str, bool] = {}

    def _channel(self, endpoint: str) -> grpc.aio.Channel:
        ch = self._channels.get(endpoint)
        if ch is None:
            ch = self._channels[endpoint] = grpc.aio.insecure_channel(endpoint, options=GRPC_OPTIONS)
        return ch

    def _stub(self, endpoint: str) -> pb_grpc.PrefillStub:
        stub = self._stubs.get(endpoint)
        if stub is None:
            stub = self._stubs[endpoint] = pb_grpc.PrefillStub(self._channel(endpoint))
        return stub

    def _quarantine(self, rid: str, endpoint: str) -> None:
        """A remote prefill into our blocks failed or was cancelled: hold the blocks, and ask the
        prefill worker to abort the request and say whether any write can still land; if none
        can, free them at once, else they wait out --kv-quarantine."""
        aeng = self.ctx.engine
        aeng.quarantine(rid, self.ctx.config.kv_quarantine_s)

        async def settle() -> None:
            try:
                resp = await pb_grpc.WorkerStub(self._channel(endpoint)).Abort(
                    pb.AbortRequest(request_id=rid), timeout=SETTLE_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:  # unreachable: its writes may be in limbo, keep the quarantine
                log.info("event=kv_settle_unknown rid=%s prefill=%s code=%s", rid, endpoint, e.code().name)
                return
            if resp.writes_settled:
                aeng.release_held(rid)
            log.info("event=kv_settle rid=%s prefill=%s settled=%s", rid, endpoint, resp.writes_settled)

        task = asyncio.create_task(settle())
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def cancel_remote(self, rid: str) -> bool:
        call = self._remote_calls.pop(rid, None)
        if call is not None:
            call.cancel()
        return call is not None

    # -- getting the prompt's K/V -----------------------------------------------------

    async def _reserve(self, rid: str, ids: list[int], sampling: SamplingParams, tenant: str,
                       weight: float = 1.0, adapter: str = "", priority: int = 0) -> tuple[int, list[int]]:
        aeng = self.ctx.engine
        deadline = time.monotonic() + self.ctx.config.reserve_timeout_s

        while True:
            try:
                got = await aeng.reserve(rid, ids, sampling, tenant, weight, adapter, priority)
            except RequestError as e:
                raise GenerateError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
            if got is not None:
                return got
            if time.monotonic() > deadline:
                raise GenerateError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"no free KV blocks for {len(ids)} tokens within {self.ctx.config.reserve_timeout_s:.0f}s")
            await asyncio.sleep(RESERVE_RETRY_S)

    async def _remote_prefill(self, rid: str, request: pb.GenerateRequest, cached: int, blocks: list[int],
                              trace: _Trace | None = None) -> None:
        assert self.region is not None and self.segment is not None
        bs = self.ctx.engine.block_size
        first = cached // bs
        endpoint = request.prefill_endpoint
        landing = None
        if self.ctx.config.kv_landing and self._lands.get(endpoint, True):
            landing = await self.ctx.engine.take_landing(rid, first)
        dest = pb.KVDestination(
            segment=self.segment, base_address=self.region.base_address, num_blocks=self.region.num_blocks,
            num_layers=self.region.num_layers, page_bytes=self.region.page_bytes, first_block=first,
            block_ids=blocks[first:], ranks=self.peer_ranks, landing_block_ids=landing or [],
            kv_dtype=kv_dtype_name(self.ctx.engine.llm.kv.layout.dtype),
        )
        preq = pb.PrefillRequest(request_id=rid, token_ids=request.token_ids, sampling=request.sampling,
                                 tenant=request.tenant, destination=dest,
                                 tenant_weight=request.tenant_weight, adapter=request.adapter,
                                 priority=request.priority)
        span = trace.prefill_call(preq, endpoint, len(blocks) - first) if trace is not None else None
        call = self._stub(endpoint).Prefill(preq, timeout=self.ctx.config.prefill_timeout_s,
                                            metadata=grpc_metadata(preq.traceparent))
        self._remote_calls[rid] = call
        try:
            resp: pb.PrefillResponse = await call
        except asyncio.CancelledError:
            call.cancel()
            self._quarantine(rid, endpoint)
            if span is not None:
                end_span(span, error="cancelled")
            raise
        except grpc.aio.AioRpcError as e:
            if span is not None:
                end_span(span, error=f"{e.code().name}: {e.details()}")
            self._quarantine(rid, endpoint)
            code = e.code()
            if code == grpc.StatusCode.CANCELLED:
                raise GenerateError(code, f"request {rid} was aborted during prefill") from e
            if code not in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED,
                            grpc.StatusCode.RESOURCE_EXHAUSTED):
                code = grpc.StatusCode.UNAVAILABLE
            raise GenerateError(code, f"prefill worker {endpoint} failed: {e.code().name}: {e.details()}",
                                failed_prefill=endpoint) from e
        finally:
            self._remote_calls.pop(rid, None)
        lp = logprob_from_proto(resp.logprob) if resp.HasField("logprob") else None
        self._lands[endpoint] = bool(resp.landable)
        landed = [(s.rank, s.first, s.count) for s in resp.landable] if resp.landed else None
        if landed and landing is None:
            self._quarantine(rid, endpoint)
            raise GenerateError(grpc.StatusCode.UNAVAILABLE, f"prefill worker {endpoint} wrote into landing blocks "
                                "it was not offered", failed_prefill=endpoint)
        if span is not None:
            end_span(span, transfer_bytes=resp.transfer_bytes, transfer_entries=resp.transfer_entries,
                     transfer_seconds=resp.transfer_seconds, prefill_queue_seconds=resp.queue_seconds,
                     prefill_compute_seconds=resp.compute_seconds, prefill_cached_tokens=resp.cached_tokens,
                     landed=bool(landed))
        log.info("event=kv_received rid=%s prefill=%s bytes=%d entries=%d transfer_s=%.4f prefill_cached=%d "
                 "landed=%s", rid, endpoint, resp.transfer_bytes, resp.transfer_entries, resp.transfer_seconds,
                 resp.cached_tokens, bool(landed))
        # Prompt tokens nobody computed: this worker's hits and the prefill worker's own.
        cached_total = len(request.token_ids) - resp.computed_tokens
        await self.ctx.engine.activate(rid, resp.first_token, lp, cached_total, landed)

    async def _decide(self, rid: str, request: pb.GenerateRequest, ids: list[int], sampling: SamplingParams
                      ) -> tuple[PrefillDecision, int, list[int]]:
        """Reserve the prompt's blocks and decide where it is prefilled: (decision, cached, blocks).
        The colocated role queues the request here and prefills in the batch."""
        aeng, cfg, tier = self.ctx.engine, self.ctx.config, self.ctx.kv_tier
        if cfg.role == "both" or self.region is None:
            # With blocks in the cluster-wide KV store, the prompt is filled from it when the
            # scheduler admits it (its turn in the queue, like any other) and computes the rest.
            fetch = tier is not None and await tier.held(cache_scope(request.tenant, request.adapter), ids) > 0
            try:
                await aeng.add_request(rid, ids, sampling, request.tenant, fetch=fetch,
                                       weight=request.tenant_weight or 1.0, adapter=request.adapter,
                                       priority=request.priority)
            except RequestError as e:
                raise GenerateError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
            return PrefillDecision(False, "colocated"), 0, []
        cached, blocks = await self._reserve(rid, ids, sampling, request.tenant, request.tenant_weight or 1.0,
                                             request.adapter, request.priority)
        if tier is not None:  # consult the cluster-wide KV store before asking a prefill worker
            cached = await tier.fill(rid)
        decision = decide_prefill(len(ids), cached, bool(request.prefill_endpoint),
                                  cfg.local_prefill_max_tokens, cfg.local_prefill_max_fraction)
        self.ctx.metrics.prefill_mode.labels(role=cfg.role, mode="remote" if decision.remote else "local",
                                             reason=decision.reason).inc()
        log.info("event=prefill_decision rid=%s remote=%s reason=%s prompt=%d cached=%d",
                 rid, decision.remote, decision.reason, len(ids), cached)
        return decision, cached, blocks

    async def _prefill(self, rid: str, request: pb.GenerateRequest, decision: PrefillDecision, cached: int,
                       blocks: list[int], trace: _Trace | None = None) -> None:
        if decision.reason == "colocated":
            return
        if decision.remote:
            await self._remote_prefill(rid, request, cached, blocks, trace)
        else:
            await self.ctx.engine.start_local_prefill(rid)

    def _finished(self, rid: str, request: pb.GenerateRequest, out: RequestOutput, mode: str, total_s: float,
                  sent_direct: int) -> None:
        ctx, m = self.ctx, self.ctx.metrics
        m.requests.labels(role=ctx.config.role, outcome=out.finish_reason or "stop").inc()
        if request.adapter:
            m.adapter_requests.labels(role=ctx.config.role, adapter=request.adapter).inc()
            m.adapter_tokens.labels(role=ctx.config.role, adapter=request.adapter,
                                    kind="prompt").inc(out.num_prompt_tokens)
            m.adapter_tokens.labels(role=ctx.config.role, adapter=request.adapter,
                                    kind="completion").inc(out.num_output_tokens)
        log.info("event=generate_done rid=%s mode=%s prompt=%d cached=%d output=%d finish=%s total_s=%.3f "
                 "sent_direct=%d priority=%d", rid, mode, out.num_prompt_tokens, out.num_cached_tokens,
                 out.num_output_tokens, out.finish_reason, total_s, sent_direct, request.priority)

    # -- the RPC ----------------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                       direct: Callable[[pb.GenerateEvent], None] | None = None) -> AsyncIterator[pb.GenerateEvent]:
        """The request's events. `direct` (the mux connection's, decode_worker/mux_stream.py): after the
        first event, an output of plain tokens is turned into its event as the engine hands it out and given
        to `direct` instead of being yielded — this loop's work for it done there (`plain` below), without a
        task switch per token per stream. Everything else is yielded as always; the order is kept (an
        output is offered to `plain` only while this loop waits with nothing held)."""
        ctx, aeng = self.ctx, self.ctx.engine
        await ctx.refuse_if_draining(context)
        if request.model and request.model != ctx.model_name:  # (a worker hosting several: hosted_service.py)
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model {request.model!r} is not served by this worker "
                                f"(it serves {ctx.model_name})")
        rid = request.request_id or uuid.uuid4().hex
        try:
            ids = token_ids_from_proto(request.token_ids)
            sampling = sampling_from_proto(request.sampling)
        except RequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        t0 = time.perf_counter()
        trace = (_Trace(ctx.tracing, request, ctx.tracing.incoming(request.traceparent, context), rid, len(ids), t0)
                 if ctx.tracing is not None else None)
        stream = aeng.open_stream(rid)
        ctx.inflight.add(rid)
        done = False
        m, lbl = ctx.metrics, ctx.metrics.labels
        try:
            try:
                decision, cached, blocks = await self._decide(rid, request, ids, sampling)
                mode = "colocated" if decision.reason == "colocated" else ("remote" if decision.remote else "local")
                if trace is not None:
                    trace.decided(mode, decision.reason, cached)
                if request.prefill_endpoint:
                    # Say where the prompt is prefilled before doing it: the router moves its
                    # prefill load estimate to this worker when it is prefilled here.
                    yield pb.GenerateEvent(prefill_mode=mode, prefill_reason=decision.reason)
                await self._prefill(rid, request, decision, cached, blocks, trace)
            except GenerateError as e:
                done = True
                m.requests.labels(role=ctx.config.role, outcome="error").inc()
                log.warning("event=generate_failed rid=%s code=%s error=%r", rid, e.code.name, str(e))
                if trace is not None:
                    trace.finish(None, f"{e.code.name}: {e}")
                await context.abort(e.code, str(e), trailing_metadata=e.trailing_metadata())
            pace = _Pace(ctx.config.stream_interval, m.itl.labels(**lbl))
            if direct is not None:
                pace.send = direct
                stream.sink = pace.plain
            async for got in stream:
                out = pace.take(got)
                if out is None:
                    continue
                now = time.perf_counter()
                if out.error is not None:
                    done = True
                    m.requests.labels(role=ctx.config.role, outcome="error").inc()
                    await context.abort(grpc.StatusCode.INTERNAL, f"request {rid}: {out.error}")
                if out.finish_reason == "abort":
                    done = True
                    await context.abort(grpc.StatusCode.CANCELLED, f"request {rid} was aborted")
                ev = event_from_output(out)
                if pace.last is None:
                    ev.prefill_mode, ev.prefill_reason = mode, decision.reason
                    m.ttft.labels(**lbl).observe(now - t0)
                    if trace is not None:
                        trace.first_token(now)
                pace.observe(out, now)
                if out.finished:
                    done = True
                    self._finished(rid, request, out, mode, now - t0, pace.sent_direct)
                    if trace is not None:
                        trace.finish(out)
                yield ev
        finally:
            if trace is not None:
                trace.finish(None, None if done else "cancelled")  # (a no-op once finished)
            aeng.close_stream(rid)
            ctx.inflight.discard(rid)
            if not done:  # the client went away (or the router cancelled): stop the work everywhere
                log.info("event=generate_cancelled rid=%s", rid)
                if rid in self._remote_calls:
                    await self.cancel_remote(rid)
                else:
                    aeng.abort(rid)


class _Trace:
    """The spans of one Generate call (common/tracing.py): `decode.generate` (the call, under the router's
    attempt), `decode.queue` (until its blocks are reserved and where to prefill is decided),
    `decode.prefill` (the prefill worker's call, or the local prefill until the first token), a
    `first_token` event, and `decode.stream` (first token to the end)."""

    def __init__(self, tracing: Tracing, request: pb.GenerateRequest, traceparent: str, rid: str, prompt_tokens: int,
                 t0: float):
        self.tr = tracing
        self.t0 = t0
        self.span = tracing.span("decode.generate", tracing.extract(traceparent), "server",
                                 {"splitfire.request_id": rid, "splitfire.prompt_tokens": prompt_tokens,
                                  "splitfire.priority": request.priority, "splitfire.tenant": request.tenant},
                                 start_s=t0)
        self.decided_at: float | None = None
        self.mode = ""
        self.first: float | None = None
        self.ended = False

    def decided(self, mode: str, reason: str, cached: int) -> None:
        self.decided_at, self.mode = time.perf_counter(), mode
        self.span.set_attributes({"splitfire.prefill_mode": mode, "splitfire.prefill_reason": reason})
        end_span(self.tr.span("decode.queue", self.span, start_s=self.t0), end_s=self.decided_at,
                 cached_tokens=cached)

    def prefill_call(self, preq: pb.PrefillRequest, endpoint: str, blocks: int) -> Any:
        span = self.tr.span("decode.prefill", self.span, "client",
                            {"splitfire.prefill": endpoint, "splitfire.blocks": blocks, "rpc.method": "Prefill"})
        preq.traceparent = self.tr.traceparent(span)
        return span

    def first_token(self, now: float) -> None:
        self.first = now
        self.span.add_event("first_token", timestamp=wall_ns(now))
        if self.mode in ("local", "colocated") and self.decided_at is not None:
            end_span(self.tr.span("decode.prefill", self.span, start_s=self.decided_at), end_s=now, mode=self.mode)

    def finish(self, out: RequestOutput | None, error: str | None = None) -> None:
        if self.ended:
            return
        self.ended = True
        now = time.perf_counter()
        if self.first is not None:
            end_span(self.tr.span("decode.stream", self.span, start_s=self.first), end_s=now, error=error,
                     output_tokens=out.num_output_tokens if out is not None else None)
        end_span(self.span, end_s=now, error=error,
                 **({"output_tokens": out.num_output_tokens, "cached_tokens": out.num_cached_tokens,
                     "finish_reason": out.finish_reason} if out is not None else {}))


class _Pace:
    """One stream's pacing: outputs held back until --stream-interval tokens are ready (the first token and
    the end go at once), the inter-token metric, and the direct path (`plain`: an output of plain tokens
    turned into its event as the engine hands it out, while the loop waits with nothing held)."""

    def __init__(self, interval: int, itl: Any):
        self.interval = interval
        self.itl = itl  # (per token: the metric child once, not a label lookup each)
        self.last: float | None = None  # when the last event went out
        self.pending: RequestOutput | None = None
        self.sent_direct = 0  # tokens that went the direct way (the log line says)
        self.send: Callable[[pb.GenerateEvent], None] | None = None

    def plain(self, out: RequestOutput) -> bool:
        n = len(out.token_ids)
        if (self.pending is not None or self.last is None or out.finished or out.error is not None
                or n < self.interval):
            return False
        assert self.send is not None
        now = time.perf_counter()
        per = (now - self.last) / n
        for _ in range(n):
            self.itl.observe(per)
        self.last = now
        self.sent_direct += n
        self.send(event_from_output(out))
        return True

    def take(self, got: RequestOutput) -> RequestOutput | None:
        """`got` folded into what is held; the output due now, if any."""
        if self.pending is None:
            self.pending = got
        else:
            self.pending.merge(got)
        if self.last is not None and not self.pending.finished and len(self.pending.token_ids) < self.interval:
            return None
        out, self.pending = self.pending, None
        return out

    def observe(self, out: RequestOutput, now: float) -> None:
        if self.last is not None and out.token_ids:
            per = (now - self.last) / len(out.token_ids)
            for _ in out.token_ids:
                self.itl.observe(per)
        self.last = now

