"""gRPC `Prefill`: compute a prompt (reusing this worker's prefix cache), write its K/V into
the decode worker's blocks layer by layer, return the first token."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import grpc

from common.block_hash import cache_scope
from common.errors import ModelLoadError, RequestError
from common.tracing import Tracing
from common.tracing import end as end_span
from engine.batch.sequence import Mode
from kvtransfer.descriptors import KVRegion
from prefill_worker.kv_sender import LayerwiseKVSender, TransferPlan
from protos import splitfire_pb2 as pb
from protos import splitfire_pb2_grpc as pb_grpc
from worker.convert import kv_dtype_name, logprob_to_proto, sampling_from_proto, token_ids_from_proto
from worker.kv.routes import KVSplit, stage_layout
from worker.worker_service import WorkerContext

log = logging.getLogger("splitfire.prefill")


def plan_from_request(request: pb.PrefillRequest, rid: str, own: KVRegion, split: KVSplit, n: int,
                      kv_dtype: str = "") -> TransferPlan:
    """`split`: how this worker's pages are split over its ranks; the decode worker may be split over
    another number of ranks (its rank 0 plus `destination.ranks`): each head goes where it is held.
    `kv_dtype`: this worker's KV element type, checked against the decode worker's."""
    d = request.destination
    if not d.segment:
        raise RequestError("destination.segment is empty")
    if d.kv_dtype and kv_dtype and d.kv_dtype != kv_dtype:
        raise RequestError(f"decode worker's KV cache holds {d.kv_dtype}, this prefill worker's {kv_dtype}: start "
                           "both with the same --kv-cache-dtype (and --dtype)")
    # Each decode rank's layers: rank 0's region holds `num_layers` from layer 0; a rank that names none
    # holds the same layers (tensor parallel only).
    held = [range(0, d.num_layers)] + [range(r.first_layer, r.first_layer + (r.num_layers or d.num_layers))
                                       for r in d.ranks]
    try:
        dst_tp, dst_stages = stage_layout(held, split.cfg.num_layers)
    except ValueError as e:
        raise RequestError(f"decode worker's KV layout is incompatible: {e} (layer count differs: another "
                           "model?)") from e
    shape = f"{dst_tp} tensor-parallel rank(s) x {len(dst_stages)} stage(s)"
    own_shape = f"{split.size} x {len(split.stage_ranges)}"
    try:
        routes = split.routes_to(dst_tp, dst_stages)
    except ModelLoadError as e:
        raise RequestError(f"decode worker's KV is split over {dst_tp} tensor-parallel rank(s), this prefill "
                           f"worker's over {split.size}, and the model cannot be: {e}") from e
    for route in routes:
        why = route.part.check(own, KVRegion(d.base_address, d.num_layers, d.num_blocks, d.page_bytes))
        if why is not None:
            raise RequestError(f"decode worker's KV layout is incompatible: {why} (decode worker split over "
                               f"{shape}, this prefill worker over {own_shape})")
    n_blocks = -(-n // split.block_size)
    if not 0 <= d.first_block < n_blocks:
        raise RequestError(f"destination.first_block {d.first_block} outside the prompt's {n_blocks} blocks")
    if len(d.block_ids) != n_blocks - d.first_block:
        raise RequestError(f"destination has {len(d.block_ids)} block ids, the prompt needs {n_blocks - d.first_block}")
    bad = [b for b in d.block_ids if b >= d.num_blocks]
    if bad:
        raise RequestError(f"destination block ids {bad[:5]} outside the decode worker's {d.num_blocks} blocks")
    landing = list(d.landing_block_ids) or None
    if landing is not None:
        if len(landing) != len(d.block_ids):
            raise RequestError(f"destination has {len(landing)} landing block ids for {len(d.block_ids)} blocks")
        if max(landing) >= d.num_blocks or len(set(landing)) != len(landing) or set(landing) & set(d.block_ids):
            raise RequestError("destination landing block ids must be distinct blocks of the decode worker's "
                               f"{d.num_blocks}, none of them a destination block")
    dests = [(d.segment, d.base_address, len(held[0]))] + [(r.segment, r.base_address, len(h))
                                                            for r, h in zip(d.ranks, held[1:], strict=True)]
    return TransferPlan(rid, dests, (d.num_blocks, d.page_bytes), d.first_block, list(d.block_ids), routes, landing)


def landable_sections(plan: TransferPlan) -> list[pb.KVSection]:
    """The decode ranks' head sections this worker sends as whole pages when offered landing blocks."""
    sections = dict.fromkeys((r.dst_rank, r.part.dst_first, r.part.count) for r in plan.routes if r.part.landable)
    return [pb.KVSection(rank=rank, first=first, count=count) for rank, first, count in sections]


def _trace(tr: Tracing, request: pb.PrefillRequest, traceparent: str, rid: str, prompt: int, cached: int,
           store_blocks: int, plan: TransferPlan, layers: int, t0: float) -> None:
    """The spans of one finished Prefill call (common/tracing.py), under the decode worker's prefill-call
    span: `prefill.prefill` (the call), `prefill.queue` (until its first forward step), `prefill.compute`
    (its forward steps) and `kv.transfer` (the layer-by-layer writes into the decode worker's blocks)."""
    span = tr.span("prefill.prefill", tr.extract(traceparent), "server",
                   {"splitfire.request_id": rid, "splitfire.prompt_tokens": prompt, "splitfire.cached_tokens": cached,
                    "splitfire.kv_store_hit_blocks": store_blocks, "splitfire.priority": request.priority,
                    "splitfire.tenant": request.tenant}, start_s=t0)
    if plan.forward_started:
        end_span(tr.span("prefill.queue", span, start_s=t0), end_s=plan.forward_started)
        end_span(tr.span("prefill.compute", span, start_s=plan.forward_started), end_s=plan.forward_ended,
                 compute_seconds=plan.compute_s, computed_tokens=prompt - cached)
    if plan.started:
        end_span(tr.span("kv.transfer", span, "client", start_s=plan.started), end_s=plan.finished,
                 bytes=plan.bytes, entries=plan.entries, layers=layers, blocks=len(plan.dst_blocks),
                 decode_ranks=len(plan.dests), landed=plan.landed)
    end_span(span)


class PrefillService(pb_grpc.PrefillServicer):
    def __init__(self, ctx: WorkerContext, sender: LayerwiseKVSender, region: KVRegion):
        self.ctx = ctx
        self.sender = sender
        self.region = region

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        ctx, aeng = self.ctx, self.ctx.engine
        await ctx.refuse_if_draining(context)
        rid = request.request_id or uuid.uuid4().hex
        t0 = time.perf_counter()
        try:
            ids = token_ids_from_proto(request.token_ids)
            sampling = sampling_from_proto(request.sampling)
            plan = plan_from_request(request, rid, self.region, self.sender.split, len(ids),
                                     kv_dtype_name(aeng.llm.kv.layout.dtype))
        except RequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        stream = aeng.open_stream(rid)
        ctx.inflight.add(rid)
        added = False
        try:
            # With blocks in the cluster-wide KV store past this worker's own hit, the prompt is
            # filled from it when admitted, and only the rest is computed (and sent on).
            store_blocks = (await ctx.kv_tier.held(cache_scope(request.tenant, request.adapter), ids)
                            if ctx.kv_tier is not None else 0)
            fetch = store_blocks > 0

            def admit(engine) -> None:
                self.sender.add_plan(plan)
                try:
                    engine.add_request(rid, ids, sampling, request.tenant, Mode.PREFILL_ONLY, fetch=fetch,
                                       weight=request.tenant_weight or 1.0, adapter=request.adapter,
                                       priority=request.priority)
                except BaseException:
                    self.sender.remove_plan(rid)
                    raise

            # Counted as added from the moment the admit is queued: a cancel that arrives while it
            # waits behind a running step queues its abort after it, so the prompt never runs.
            added = True
            try:
                await aeng.call(admit)
            except RequestError as e:
                added = False
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            out = await stream.next()
            assert out is not None and out.finished
            if out.error is not None:
                ctx.metrics.requests.labels(role="prefill", outcome="error").inc()
                log.warning("event=prefill_failed rid=%s error=%r", rid, out.error)
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"prefill {rid}: {out.error}")
            if out.finish_reason == "abort":
                await context.abort(grpc.StatusCode.CANCELLED, f"prefill {rid} aborted")
            added = False
            m = ctx.metrics
            m.requests.labels(role="prefill", outcome="ok").inc()
            m.transfer_bytes.labels(**m.labels).inc(plan.bytes)
            m.transfer_entries.labels(**m.labels).inc(plan.entries)
            m.transfer_seconds.labels(**m.labels).observe(plan.transfer_s)
            resp = pb.PrefillResponse(
                first_token=out.token_ids[0], cached_tokens=out.num_cached_tokens,
                computed_tokens=len(ids) - out.num_cached_tokens, transfer_bytes=plan.bytes,
                transfer_entries=plan.entries, transfer_seconds=plan.transfer_s, compute_seconds=plan.compute_s,
                queue_seconds=max(plan.started - t0, 0.0) if plan.started else 0.0,
                landable=landable_sections(plan), landed=plan.landed,
            )
            if out.logprobs:
                resp.logprob.CopyFrom(logprob_to_proto(out.logprobs[0]))
            if ctx.tracing is not None:
                _trace(ctx.tracing, request, ctx.tracing.incoming(request.traceparent, context), rid, len(ids),
                       out.num_cached_tokens, store_blocks, plan, self.sender.split.cfg.num_layers, t0)
            log.info("event=prefill_done rid=%s tokens=%d cached=%d bytes=%d entries=%d transfer_s=%.4f total_s=%.4f "
                     "priority=%d", rid, len(ids), out.num_cached_tokens, plan.bytes, plan.entries, plan.transfer_s,
                     time.perf_counter() - t0, request.priority)
            return resp
        except asyncio.CancelledError:
            log.info("event=prefill_cancelled rid=%s", rid)
            raise
        finally:
            aeng.close_stream(rid)
            ctx.inflight.discard(rid)
            if added:  # cancelled or failed mid-way: stop computing; writes finish before blocks are freed
                aeng.abort(rid)
            aeng.call(lambda e: self.sender.remove_plan(rid))
