"""Decode.Generate for a colocated worker serving several base models (`--on-demand-model`): the request's
`model` is made resident (`worker/model_host.py`: loaded, least recently used evicted) and its own
`DecodeService` runs the request; the model counts as in use until the stream ends."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

import grpc

from common.errors import RequestError
from protos import splitfire_pb2 as pb
from protos import splitfire_pb2_grpc as pb_grpc
from worker.model_host import ModelHost, ModelUnavailable
from worker.worker_service import WorkerContext

log = logging.getLogger("splitfire.decode")


class HostedDecodeService(pb_grpc.DecodeServicer):
    def __init__(self, ctx: WorkerContext, host: ModelHost):
        self.ctx = ctx  # the worker's (its first model's): draining, requests in flight
        self.host = host

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                       direct: Callable[[pb.GenerateEvent], None] | None = None) -> AsyncIterator[pb.GenerateEvent]:
        await self.ctx.refuse_if_draining(context)
        try:
            model = await self.host.acquire(request.model)
        except RequestError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except ModelUnavailable as e:
            log.warning("event=model_unavailable rid=%s model=%s error=%s", request.request_id, request.model, e)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        try:
            m = self.ctx.metrics
            m.model_requests.labels(role=m.role, model=model.name).inc()
            events = model.resident.service.Generate(request, context, direct)
            try:
                async for ev in events:
                    yield ev
            finally:
                await events.aclose()
        finally:
            self.host.release(model)

    async def cancel_remote(self, rid: str) -> bool:
        return False  # (colocated: no remote prefill to cancel)
