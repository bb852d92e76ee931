"""Decode.Generate served over plain HTTP/1.1 on the worker's HTTP port (`protos/frames.py`):
the same handler as the gRPC call, its events written as length-prefixed frames."""

from __future__ import annotations

import logging

import grpc
from aiohttp import web

from decode_worker.hosted_service import HostedDecodeService
from decode_worker.service import DecodeService
from protos import frames, trailers
from protos import splitfire_pb2 as pb

log = logging.getLogger("splitfire.decode")


class StreamAborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, metadata: dict[str, str]):
        super().__init__(details)
        self.code, self.details, self.metadata = code, details, metadata


class FrameContext:
    """What the Generate handler needs of a gRPC context: `abort` ends the stream with an
    ERROR frame carrying the status and the blamed endpoint."""

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        raise StreamAborted(code, details, dict(trailing_metadata))


def add_routes(app: web.Application, service: DecodeService | HostedDecodeService) -> None:
    async def generate(request: web.Request) -> web.StreamResponse:
        try:
            msg = pb.GenerateRequest.FromString(await request.read())
        except Exception as e:  # protobuf raises DecodeError (and others) for a malformed body
            raise web.HTTPBadRequest(text=f"body is not a GenerateRequest: {type(e).__name__}: {e}") from e
        # A drain waits for this response to be written out, not only for the request to finish
        # (the last frames must leave before the process exits).
        marker = f"http-stream-{id(request)}"
        service.ctx.inflight.add(marker)
        try:
            return await _stream(msg, request)
        finally:
            service.ctx.inflight.discard(marker)

    async def _stream(msg: pb.GenerateRequest, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": frames.CONTENT_TYPE})
        await resp.prepare(request)
        events = service.Generate(msg, FrameContext())
        try:
            async for ev in events:
                await resp.write(frames.encode(frames.EVENT, ev.SerializeToString()))
        except StreamAborted as e:
            await resp.write(frames.encode_error(e.code.name, e.details, e.metadata.get(trailers.FAILED_ENDPOINT, ""),
                                                 e.metadata.get(trailers.FAILED_ROLE, "")))
        except ConnectionResetError:  # the router went away: closing the events below cancels the request
            log.info("event=stream_reader_gone rid=%s", msg.request_id)
            return resp
        finally:
            await events.aclose()
        await resp.write_eof()
        return resp

    app.router.add_post(frames.PATH, generate)
