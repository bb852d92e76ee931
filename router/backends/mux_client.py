"""Every token stream to one worker on one connection (`protos/frames.py`, MUX_PATH).

A plain stream costs the router a socket read (and the worker a write) per token per stream; here a
worker's step reaches the router as one read holding every stream's frames, which are handed to the
streams' readers in that one callback. The connection is an HTTP/1.1 POST whose chunked request body
(OPEN and CANCEL frames) and chunked response (EVENT and ERROR frames) both stay open; it is made on a
worker's first stream and kept. If it breaks, every stream on it fails as a broken plain stream would
(the router resumes them elsewhere), and the next stream opens a new one.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

from protos import frames
from router.backends.http_client import HTTPClientError, Origin, Response, chunk

log = logging.getLogger("splitfire.router")


class MuxStream:
    """One stream's frames as they arrive, until its last (or the connection's failure).

    `sink` (optional) takes a frame synchronously, in the connection's read callback: it returns True
    when it has dealt with the frame in full (the direct relay writes a plain token straight to the
    client), False to leave it to the stream's reader as any other. It is offered a frame only while the
    reader waits in `take` with nothing queued, so frames are handled in their order either way."""

    __slots__ = ("error", "frames", "sink", "waiter")

    def __init__(self) -> None:
        self.frames: list[tuple[int, bytes]] = []
        self.waiter: asyncio.Future[None] | None = None
        self.error: BaseException | None = None
        self.sink: Callable[[int, bytes], bool] | None = None

    def offer(self, kind: int, payload: bytes) -> None:
        """A frame from the connection: to the sink when it may take it, else queued for the reader."""
        sink, w = self.sink, self.waiter
        # (A reader still waiting has nothing queued: a queued frame wakes it.)
        if sink is not None and w is not None and not w.done() and sink(kind, payload):
            return
        self.frames.append((kind, payload))
        self.wake()

    def wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def take(self) -> list[tuple[int, bytes]]:
        """The frames that have arrived (waiting for at least one); raises the connection's failure."""
        while not self.frames:
            if self.error is not None:
                raise self.error
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        out, self.frames = self.frames, []
        return out


class MuxConnection(Response):
    """The connection to one worker: its HTTP response parsed by `Response` (head, chunked body), the
    body cut into frames and handed to the streams."""

    def __init__(self, loop: asyncio.AbstractEventLoop, origin: Origin):
        super().__init__(loop, origin)
        self.reader = frames.MuxReader()
        self.streams: dict[int, MuxStream] = {}
        self._next = 0

    @property
    def usable(self) -> bool:
        t = self.transport
        return t is not None and not t.is_closing() and self._exc is None and not self._complete

    def open(self, request: bytes) -> tuple[int, MuxStream]:
        self._next = (self._next + 1) & 0xFFFFFFFF
        sid = self._next
        stream = self.streams[sid] = MuxStream()
        self._send(frames.OPEN, sid, request)
        return sid, stream

    def finish(self, sid: int, cancel: bool) -> None:
        """The reader is done with stream `sid`; `cancel`: before its last frame (the worker stops it)."""
        if self.streams.pop(sid, None) is not None and cancel and self.usable:
            self._send(frames.CANCEL, sid, b"")

    def fail(self, sid: int, error: BaseException) -> None:
        stream = self.streams.get(sid)
        if stream is not None and stream.error is None:
            stream.error = error
            stream.wake()

    def _send(self, kind: int, sid: int, payload: bytes) -> None:
        assert self.transport is not None
        frame = frames.encode_mux(kind, sid, payload)
        self.transport.write(chunk(frame))

    def _wake(self) -> None:  # (Response's hook after every read, close or timeout)
        if self._head_done and self.status != 200 and self._exc is None:
            self._exc = HTTPClientError(f"{self.origin.host}:{self.origin.port} answered {self.status} to "
                                        f"{frames.MUX_PATH}: {bytes(self._body[:200]).decode(errors='replace')}")
            self._body.clear()
            if self.transport is not None:
                self.transport.close()
        if self._body:
            data = bytes(self._body)
            self._body.clear()
            try:
                parsed = self.reader.feed(data)
            except ValueError as e:  # a frame over the limit: the stream is not what we speak
                parsed = []
                self._exc = HTTPClientError(f"bad frame from {self.origin.host}:{self.origin.port}: {e}")
                if self.transport is not None:
                    self.transport.close()
            streams = self.streams
            for kind, sid, payload in parsed:
                stream = streams.get(sid)
                if stream is not None:  # (else cancelled here, its last frames still in flight)
                    stream.offer(kind, payload)
        if self._exc is not None or self._complete:
            error = self._exc or HTTPClientError(f"{self.origin.host}:{self.origin.port} ended the stream connection")
            for stream in self.streams.values():
                if stream.error is None:
                    stream.error = error
                    stream.wake()


class MuxClient:
    """One connection per worker (host, stream port), opened on its first stream and kept."""

    def __init__(self, connect_timeout_s: float = 5.0):
        self.connect_timeout_s = connect_timeout_s
        self._conns: dict[tuple[str, int], MuxConnection] = {}
        self._opening: dict[tuple[str, int], asyncio.Future[MuxConnection]] = {}

    async def connection(self, host: str, port: int) -> MuxConnection:
        key = (host, port)
        conn = self._conns.get(key)
        if conn is not None and conn.usable:
            return conn
        opening = self._opening.get(key)
        if opening is not None:  # (another stream is opening it: share)
            return await asyncio.shield(opening)
        fut: asyncio.Future[MuxConnection] = asyncio.get_running_loop().create_future()
        self._opening[key] = fut
        try:
            conn = await self._open(host, port)
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # (retrieved: the sharers re-raise it, or nobody shared)
            raise
        finally:
            del self._opening[key]
        fut.set_result(conn)
        self._conns[key] = conn
        return conn

    async def _open(self, host: str, port: int) -> MuxConnection:
        loop = asyncio.get_running_loop()
        origin = Origin("http", host, port, "", f"{host}:{port}")
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: MuxConnection(loop, origin), host, port), self.connect_timeout_s)
        except (OSError, TimeoutError) as e:
            raise HTTPClientError(f"cannot connect to {host}:{port}: {type(e).__name__}: {e}") from e
        assert conn.transport is not None
        sock = conn.transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Streams are opened at once, without waiting for the response head: it may come with the
        # first frame (a server may hold headers back until the body starts).
        conn.transport.write((f"POST {frames.MUX_PATH} HTTP/1.1\r\nHost: {origin.host_header}\r\n"
                              f"Content-Type: {frames.MUX_CONTENT_TYPE}\r\nTransfer-Encoding: chunked\r\n\r\n"
                              ).encode("latin-1"))
        log.info("event=mux_connected address=%s:%d", host, port)
        return conn

    async def close(self) -> None:
        for conn in self._conns.values():
            if conn.transport is not None:
                conn.transport.close()
        self._conns.clear()
