"""A lean HTTP/1.1 client for streaming from OpenAI-compatible upstreams.

aiohttp's client spends ~0.3 ms setting up each request and runs a chain of callbacks and
stream-reader wake-ups per received HTTP chunk: in front of a fast upstream that was over
half of the router's CPU. Proxying a token stream needs little of it: keep-alive connections,
a POST with a JSON body, and a chunked (or Content-Length) body handed over as it arrives.
This does exactly that on an asyncio.Protocol, decoding chunked framing once per network
read, with flow control so a slow client pauses the upstream instead of buffering without bound.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from itertools import repeat
from urllib.parse import urlsplit

log = logging.getLogger("splitfire.router")

_MAX_HEAD = 64 * 1024  # a response head larger than this is not an OpenAI server's
_HIGH_WATER = 1 << 20  # decoded body bytes buffered before the socket stops being read


class HTTPClientError(Exception):
    """The connection failed or the peer spoke something that is not HTTP/1.1."""


@dataclass(frozen=True)
class Origin:
    scheme: str
    host: str
    port: int
    prefix: str  # path prefix of the base URL, e.g. "" or "/proxy"
    host_header: str  # the Host header's value

    @staticmethod
    def parse(base_url: str) -> Origin:
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        port = u.port or (443 if u.scheme == "https" else 80)
        host = f"[{u.hostname}]" if ":" in u.hostname else u.hostname  # IPv6 literal
        if port not in (80, 443):
            host = f"{host}:{port}"
        return Origin(u.scheme, u.hostname, port, u.path.rstrip("/"), host)


def chunk(data: bytes) -> bytes:
    """`data` as one chunk of a chunked HTTP/1.1 body."""
    return b"%x\r\n%b\r\n" % (len(data), data)


def _chunk_size(line: bytes) -> int:
    try:
        return int(line.split(b";", 1)[0], 16)
    except ValueError:
        raise HTTPClientError(f"bad chunk size {line[:40]!r}") from None


class Response(asyncio.Protocol):
    """One connection; holds the response currently being read on it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, origin: Origin):
        self.loop = loop
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.status = 0
        self.headers: dict[str, str] = {}
        self.keep_alive = True
        self.received_any = False  # a byte of this response arrived (else a reused idle socket may be stale)
        self._raw = bytearray()  # bytes not yet parsed
        self._body = bytearray()  # decoded body bytes not yet read
        self._head_done = False
        self._complete = False  # the whole body was received
        self._framing = ""  # "chunked" | "length" | "close"
        self._left = 0  # body bytes left: of the current chunk, or of a Content-Length body
        self._skip = 0  # CRLF bytes to skip after a chunk
        self._trailer = False  # after the last chunk, reading the trailer section
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._deadline: asyncio.TimerHandle | None = None
        self._on_end: Callable[[], None] | None = None  # nobody reads any more: call when the body ends
        # Body bytes offered as they arrive while the reader waits (the router's direct relay): True when
        # taken in full (the reader is not woken), False to leave them to the reader. Per response.
        self.sink: Callable[[bytes], bool] | None = None

    # -- protocol callbacks --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received_any = True
        self._raw += data
        try:
            if not self._head_done and not self._parse_head():
                return
            if self._framing == "chunked":
                self._parse_chunked()
            elif self._framing == "length":
                take = min(self._left, len(self._raw))
                self._body += self._raw[:take]
                del self._raw[:take]
                self._left -= take
                self._complete = self._left == 0
            else:
                self._body += self._raw
                self._raw.clear()
        except HTTPClientError as e:
            self._exc = e
            self.keep_alive = False
            if self.transport is not None:
                self.transport.close()
        if len(self._body) > _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.keep_alive = False
        if self._framing == "close" and self._head_done:
            self._complete = True
        elif not self._complete and self._exc is None:
            self._exc = HTTPClientError(f"connection to {self.origin.host}:{self.origin.port} closed "
                                        f"{'mid-response' if self.received_any else 'before a response'}"
                                        + (f": {exc}" if exc else ""))
        self._wake()

    def arm(self, timeout_s: float) -> None:
        """Fail the response (and drop the connection) unless it completes within `timeout_s`:
        one timer per request, the HTTP counterpart of a gRPC deadline."""
        self._deadline = self.loop.call_later(timeout_s, self._expire, timeout_s)

    def disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self, timeout_s: float) -> None:
        self._deadline = None
        if self._complete:
            return
        self._exc = HTTPClientError(f"no complete response from {self.origin.host}:{self.origin.port} "
                                    f"within {timeout_s:g} s")
        self.keep_alive = False
        if self.transport is not None:
            self.transport.close()
        self._wake()

    def _wake(self) -> None:
        if self._on_end is not None:  # abandoned after its content: discard the rest, wait for the end
            self._body.clear()
            if self._complete or self._exc is not None or not self.keep_alive:
                end, self._on_end = self._on_end, None
                end()
            return
        w = self._waiter
        if w is not None and not w.done():
            if (self.sink is not None and self._body and self._exc is None and not self._complete and not self._paused
                    and self.sink(bytes(self._body))):
                self._body.clear()
                return
            w.set_result(None)

    # -- parsing -------------------------------------------------------------------------

    def _parse_head(self) -> bool:
        end = self._raw.find(b"\r\n\r\n")
        if end < 0:
            if len(self._raw) > _MAX_HEAD:
                raise HTTPClientError("response head too large")
            return False
        lines = bytes(self._raw[:end]).decode("latin-1").split("\r\n")
        del self._raw[: end + 4]
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise HTTPClientError(f"not an HTTP/1.x status line: {lines[0][:100]!r}")
        if parts[1].startswith("1"):  # 100 Continue and friends: the real head follows
            return self._parse_head()
        self.status = int(parts[1])
        for line in lines[1:]:
            k, sep, v = line.partition(":")
            if sep:
                self.headers[k.strip().lower()] = v.strip()
        conn = self.headers.get("connection", "").lower()
        self.keep_alive = "close" not in conn and (parts[0] == "HTTP/1.1" or "keep-alive" in conn)
        if self.status in (204, 304):  # never a body
            self._framing = "length"
            self._complete = True
        elif "chunked" in self.headers.get("transfer-encoding", "").lower():
            self._framing = "chunked"
        elif "content-length" in self.headers:
            self._framing = "length"
            try:
                self._left = int(self.headers["content-length"])
            except ValueError:
                raise HTTPClientError(f"bad Content-Length {self.headers['content-length']!r}") from None
            self._complete = self._left == 0
        else:
            self._framing = "close"
            self.keep_alive = False
        self._head_done = True
        return True

    def _whole_chunks(self) -> None:
        """The common case at C speed: a read holding whole chunks, one SSE event each (how vLLM,
        SGLang and aiohttp servers frame a stream). Splitting at CRLF gives size, data, size, data...
        as long as no data holds a CRLF itself; every declared size must equal its data's length,
        which also proves that. Anything else (a CRLF in the data, extensions, trailers, a chunk cut
        by the read) is left to the byte-by-byte loop: 64 events cost ~40 us there, ~10 us here."""
        raw = self._raw
        parts = raw.split(b"\r\n")
        pairs = (len(parts) - 1) // 2  # a pair is whole when its data is followed by CRLF
        if not pairs:
            return
        datas = parts[1 : 2 * pairs : 2]
        try:
            sizes = list(map(int, parts[0 : 2 * pairs : 2], repeat(16)))
        except ValueError:
            return
        if sizes != list(map(len, datas)):
            return
        if 0 in sizes:  # the last chunk: its empty data is the end of an empty trailer section
            pairs = sizes.index(0) + 1
            self._complete = True
        self._body += b"".join(datas[:pairs])
        del raw[: sum(map(len, parts[: 2 * pairs])) + 4 * pairs]

    def _parse_chunked(self) -> None:
        if len(self._raw) >= 1024 and not (self._left or self._skip or self._trailer):
            self._whole_chunks()  # a read of several chunks (below this the loop is cheaper)
            if self._complete:
                return
        raw, out = self._raw, self._body
        pos, n = 0, len(raw)
        if self._left or self._skip:  # resuming a chunk split across reads
            take = min(self._left, n)
            out += raw[:take]
            self._left -= take
            pos = take if self._left else take + min(self._skip, n - take)
            self._skip -= (pos - take)
        find = raw.find
        while pos < n and not self._left and not self._skip:
            if self._trailer:
                if raw.startswith(b"\r\n", pos):
                    pos += 2
                else:
                    end = find(b"\r\n\r\n", pos)
                    if end < 0:
                        break
                    pos = end + 4
                self._complete = True
                break
            nl = find(b"\r\n", pos)
            if nl < 0:
                if n - pos > 1024:
                    raise HTTPClientError("chunk size line too long")
                break
            try:
                size = int(raw[pos:nl], 16)
            except ValueError:  # chunk extensions (";name=value"), or garbage
                size = _chunk_size(bytes(raw[pos:nl]))
            if size < 0:
                raise HTTPClientError(f"bad chunk size {bytes(raw[pos:nl][:40])!r}")
            start = nl + 2
            if size == 0:
                pos = start
                self._trailer = True
                continue
            end = start + size
            if end + 2 <= n:  # the whole chunk is here: the common case, one step
                out += raw[start:end]
                pos = end + 2
            else:
                take = min(size, n - start)
                out += raw[start : start + take]
                pos = start + take
                self._left = size - take
                skip = min(2, n - pos) if not self._left else 0
                pos += skip
                self._skip = 2 - skip
        del raw[:pos]

    # -- reading -------------------------------------------------------------------------

    async def _wait(self) -> None:
        self._waiter = self.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def head(self) -> None:
        while not self._head_done:
            if self._exc is not None:
                raise self._exc
            await self._wait()

    async def read_some(self) -> bytes:
        """The body bytes that have arrived (waiting for at least one), b"" at the end."""
        while not self._body:
            if self._exc is not None:
                raise self._exc
            if self._complete:
                return b""
            await self._wait()
        data = bytes(self._body)
        self._body.clear()
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    async def read_all(self, limit: int = 16 << 20) -> bytes:
        parts = []
        size = 0
        while data := await self.read_some():
            parts.append(data)
            size += len(data)
            if size > limit:
                raise HTTPClientError(f"response body over {limit} bytes")
        return b"".join(parts)

    @property
    def complete(self) -> bool:
        return self._complete and not self._body

    def _reset(self) -> None:
        """Ready for the next request on this keep-alive connection."""
        self.status = 0
        self.headers = {}
        self.received_any = False
        self._raw.clear()
        self._body.clear()
        self._head_done = self._complete = self._trailer = False
        self._framing = ""
        self._left = self._skip = 0
        self._exc = None
        self._on_end = None
        self.sink = None


class HTTPClient:
    """Keep-alive connection pool per origin; one request per connection at a time."""

    def __init__(self, connect_timeout_s: float = 5.0, max_idle_per_origin: int = 256):
        self.connect_timeout_s = connect_timeout_s
        self.max_idle_per_origin = max_idle_per_origin
        self._idle: dict[Origin, list[Response]] = {}
        self._ssl: ssl.SSLContext | None = None
        self._origins: dict[str, Origin] = {}
        self._ending: set[Response] = set()  # abandoned after their content, waiting for the body to end

    async def _connect(self, origin: Origin) -> Response:
        loop = asyncio.get_running_loop()
        if origin.scheme == "https" and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:
            _, proto = await asyncio.wait_for(
                loop.create_connection(lambda: Response(loop, origin), origin.host, origin.port,
                                       ssl=self._ssl if origin.scheme == "https" else None),
                self.connect_timeout_s)
        except (OSError, TimeoutError) as e:
            raise HTTPClientError(f"cannot connect to {origin.host}:{origin.port}: {type(e).__name__}: {e}") from e
        sock = proto.transport.get_extra_info("socket") if proto.transport else None
        if sock is not None and origin.scheme == "http":
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no delayed-ACK stalls on small writes
        return proto

    def _take_idle(self, origin: Origin) -> Response | None:
        pool = self._idle.get(origin)
        while pool:
            conn = pool.pop()
            if conn.transport is not None and not conn.transport.is_closing():
                return conn
        return None

    async def request(self, method: str, base_url: str, path: str, body: bytes = b"",
                      headers: dict[str, str] | None = None, timeout_s: float | None = None) -> Response:
        """Sends the request and waits for the response head. Read the body with `read_some`,
        then hand the connection back with `release` (always, also on errors). `timeout_s`
        bounds the whole exchange, head and body."""
        origin = self._origins.get(base_url)
        if origin is None:  # a handful of upstreams, parsed once each
            origin = self._origins[base_url] = Origin.parse(base_url)
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        msg = (f"{method} {origin.prefix}{path} HTTP/1.1\r\nHost: {origin.host_header}\r\n"
               f"Content-Length: {len(body)}\r\n"
               f"{extra}\r\n").encode("latin-1") + body
        conn = self._take_idle(origin)
        reused = conn is not None
        while True:
            if conn is None:
                conn = await self._connect(origin)
            transport = conn.transport
            assert transport is not None
            if timeout_s is not None:
                conn.arm(timeout_s)
            transport.write(msg)
            try:
                await conn.head()
                return conn
            except HTTPClientError:
                conn.disarm()
                transport.close()
                # An idle keep-alive socket the server had closed: retry once on a fresh one.
                if reused and not conn.received_any:
                    conn, reused = None, False
                    continue
                raise
            except BaseException:
                conn.disarm()
                transport.close()
                raise

    def release(self, conn: Response) -> None:
        """Pools the connection if its response was read to the end; closes it otherwise."""
        conn.disarm()
        t = conn.transport
        if t is None:
            return
        if conn.keep_alive and conn.complete and not conn._raw and not t.is_closing():
            conn._reset()
            pool = self._idle.setdefault(conn.origin, [])
            if len(pool) < self.max_idle_per_origin:
                pool.append(conn)
                return
        t.close()

    def release_after_end(self, conn: Response, timeout_s: float = 5.0) -> None:
        """For a response whose content has all arrived but whose body framing may still be in
        flight (an SSE stream after `[DONE]`): pool the connection when the body ends, closing it
        if that takes over `timeout_s`, without making the caller wait. A callback on the
        connection, not a task: this happens once per streamed request."""
        t = conn.transport
        if conn._complete or t is None or t.is_closing():
            conn._body.clear()
            self.release(conn)
            return
        conn.disarm()
        conn.arm(timeout_s)
        conn._body.clear()
        self._ending.add(conn)

        def end() -> None:
            self._ending.discard(conn)
            if conn._exc is not None:
                log.debug("event=upstream_drain_failed host=%s error=%r", conn.origin.host_header, conn._exc)
            self.release(conn)

        conn._on_end = end

    async def close(self) -> None:
        for conn in list(self._ending):
            conn._on_end = None
            conn.disarm()
            if conn.transport is not None:
                conn.transport.close()
        self._ending.clear()
        for pool in self._idle.values():
            for conn in pool:
                if conn.transport is not None:
                    conn.transport.close()
        self._idle.clear()
