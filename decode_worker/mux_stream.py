"""Decode.Generate multiplexed: every stream between one router and this worker on one HTTP/1.1
connection (`protos/frames.py`, MUX_PATH).

Each stream runs the same handler as the gRPC call and the plain HTTP stream; its events go into the
connection's out-buffer (a step's plain tokens straight from the engine's hand-out, `--stream-relay
direct`: no task switch per token per stream), and one writer task sends whatever has gathered in one
write. An engine step
wakes all its streams in one turn of the event loop, so the step's tokens leave together: one socket
write per step per router instead of one per token per stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiohttp import web

from decode_worker.hosted_service import HostedDecodeService
from decode_worker.http_stream import FrameContext, StreamAborted
from decode_worker.service import DecodeService
from protos import frames, trailers
from protos import splitfire_pb2 as pb

log = logging.getLogger("splitfire.decode")


class MuxConnection:
    """One router's connection: its live streams and the buffer of frames not yet written."""

    def __init__(self, service: DecodeService, resp: web.StreamResponse, peer: str):
        self.service = service
        self.resp = resp
        self.peer = peer
        self.streams: dict[int, asyncio.Task] = {}
        self._out = bytearray()
        self._ready = asyncio.Event()
        self._closed = False
        self.writer = asyncio.create_task(self._write_loop(), name=f"mux-writer-{peer}")

    def send(self, kind: int, stream: int, payload: bytes) -> None:
        self._out += frames.encode_mux(kind, stream, payload)
        self._ready.set()

    async def _write_loop(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            if not self._out:
                if self._closed:
                    return
                continue
            data, self._out = bytes(self._out), bytearray()
            await self.resp.write(data)  # (frames gathered meanwhile go in the next write)

    def open(self, stream: int, payload: bytes) -> None:
        if stream in self.streams:
            self.send(frames.ERROR, stream, frames.error_payload("INVALID_ARGUMENT", f"stream {stream} is already open"))
            return
        try:
            msg = pb.GenerateRequest.FromString(payload)
        except Exception as e:  # protobuf raises DecodeError (and others) for a malformed body
            self.send(frames.ERROR, stream, frames.error_payload(
                "INVALID_ARGUMENT", f"OPEN payload is not a GenerateRequest: {type(e).__name__}: {e}"))
            return
        self.streams[stream] = asyncio.create_task(self._run(stream, msg), name=f"mux-{stream}")

    def cancel(self, stream: int) -> None:
        task = self.streams.get(stream)
        if task is not None:
            task.cancel()  # closing the handler's events aborts the request, as a closed stream does

    async def _run(self, stream: int, msg: pb.GenerateRequest) -> None:
        ctx = self.service.ctx
        marker = f"mux-{id(self)}-{stream}"
        ctx.inflight.add(marker)  # a drain waits for the last frame to be handed to the writer
        direct = self._direct(stream) if ctx.config.stream_relay == "direct" else None
        events = self.service.Generate(msg, FrameContext(), direct)
        try:
            async for ev in events:
                self.send(frames.EVENT, stream, ev.SerializeToString())
        except StreamAborted as e:
            self.send(frames.ERROR, stream, frames.error_payload(
                e.code.name, e.details, e.metadata.get(trailers.FAILED_ENDPOINT, ""),
                e.metadata.get(trailers.FAILED_ROLE, "")))
        except asyncio.CancelledError:
            log.info("event=stream_cancelled rid=%s via=mux", msg.request_id)
        finally:
            await events.aclose()
            self.streams.pop(stream, None)
            ctx.inflight.discard(marker)

    def _direct(self, stream: int) -> Callable[[pb.GenerateEvent], None]:
        """Where the handler sends stream `stream`'s plain tokens as the engine hands them out (its direct
        path, decode_worker/service.py): framed into the out-buffer at once, as its loop would."""

        def send(ev: pb.GenerateEvent) -> None:
            self.send(frames.EVENT, stream, ev.SerializeToString())

        return send

    async def close(self) -> None:
        """The router went away (or the worker stops): cancel every stream, stop writing."""
        for task in list(self.streams.values()):
            task.cancel()
        if self.streams:
            await asyncio.gather(*self.streams.values(), return_exceptions=True)
        self._closed = True
        self._ready.set()
        try:
            await self.writer
        except (ConnectionResetError, ConnectionError) as e:
            log.info("event=mux_write_failed peer=%s error=%r", self.peer, e)


def add_mux_route(app: web.Application, service: DecodeService | HostedDecodeService) -> None:
    live: dict[MuxConnection, web.Request] = {}

    async def mux(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": frames.MUX_CONTENT_TYPE})
        await resp.prepare(request)
        conn = MuxConnection(service, resp, str(request.remote))
        live[conn] = request
        log.info("event=mux_open peer=%s", conn.peer)
        reader = frames.MuxReader()
        try:
            while data := await request.content.readany():
                for kind, stream, payload in reader.feed(data):
                    if kind == frames.OPEN:
                        conn.open(stream, payload)
                    elif kind == frames.CANCEL:
                        conn.cancel(stream)
                    else:
                        raise web.HTTPBadRequest(text=f"frame kind {kind} from a router")
        except (ValueError, ConnectionResetError) as e:  # a frame over the limit, or the router gone
            log.warning("event=mux_read_failed peer=%s error=%r", conn.peer, e)
        finally:
            live.pop(conn, None)
            await conn.close()
            log.info("event=mux_closed peer=%s", conn.peer)
        try:
            await resp.write_eof()
        except ConnectionError as e:
            log.info("event=mux_eof_failed peer=%s error=%r", conn.peer, e)
        return resp

    async def shutdown(_: web.Application) -> None:
        """The worker stops (after its drain: no stream is left): end the routers' connections, which
        would otherwise hold the HTTP server's shutdown for its whole timeout."""
        for conn, request in list(live.items()):
            await conn.close()
            if request.transport is not None:
                request.transport.close()

    app.router.add_post(frames.MUX_PATH, mux)
    app.on_shutdown.append(shutdown)
