"""A minimal pipelined Redis client for the per-request quota counters.

Every limited request runs one Lua script before it is admitted and one when it ends. Through
redis-py each call costs the router ~55-90 us of CPU (its connection pool, command packing and reply
parsing in Python) — more than half of what the router otherwise spends on a request. Here one
connection carries every call: commands issued in the same turn of the event loop leave in one write,
replies are read in order off one buffer, and a call is a future — about 7 us each under concurrency
(loadtest/bench_tenancy.py, part 3). redis-py stays the reference implementation (`quotas.RedisCounters`);
tests hold the two equal.

Replies understood: integers, simple strings, errors, bulk strings and nil (what EVALSHA of our
scripts, SCRIPT LOAD, AUTH and SELECT answer). A connection that fails, or a reply that takes longer
than `timeout_s`, fails every call in flight with `ConnectionError`; the next call reconnects, at most
once per `retry_s` (in between, calls fail at once: the quotas fall back to counting per replica).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import deque
from typing import Any
from urllib.parse import unquote, urlparse


class RedisError(Exception):
    """An error reply from Redis (the command ran and was refused)."""


def encode(*parts: bytes | str | int) -> bytes:
    out = [b"*%d\r\n" % len(parts)]
    for p in parts:
        b = p if isinstance(p, bytes) else str(p).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


class _Protocol(asyncio.Protocol):
    def __init__(self, client: PipelinedRedis):
        self.client = client
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos = 0
        waiting = self.client.waiting
        while True:
            end = buf.find(b"\r\n", pos)
            if end < 0:
                break
            kind = buf[pos]
            if kind == 36:  # '$': a bulk string, or nil
                n = int(buf[pos + 1 : end])
                if n < 0:
                    value: Any = None
                    nxt = end + 2
                else:
                    nxt = end + 2 + n + 2
                    if len(buf) < nxt:
                        break
                    value = bytes(buf[end + 2 : end + 2 + n])
            else:
                nxt = end + 2
                line = bytes(buf[pos + 1 : end])
                if kind == 58:  # ':'
                    value = int(line)
                elif kind == 43:  # '+'
                    value = line.decode()
                elif kind == 45:  # '-'
                    value = RedisError(line.decode())
                else:
                    self.client._fail(ConnectionError(f"unexpected Redis reply type {chr(kind)!r}"))
                    return
            pos = nxt
            fut, _ = waiting.popleft()
            if not fut.done():
                if isinstance(value, RedisError):
                    fut.set_exception(value)
                else:
                    fut.set_result(value)
        del buf[:pos]

    def connection_lost(self, exc: Exception | None) -> None:
        self.client._fail(ConnectionError(f"Redis connection lost: {exc or 'closed by the server'}"))


class PipelinedRedis:
    def __init__(self, url: str, timeout_s: float = 1.0, retry_s: float = 1.0):
        u = urlparse(url)
        if u.scheme not in ("redis", ""):
            raise ValueError(f"{url!r}: only redis:// URLs are supported for quota counters")
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 6379
        self.username = unquote(u.username) if u.username else None
        self.password = unquote(u.password) if u.password else None
        self.db = int(u.path.lstrip("/") or 0)
        self.timeout_s, self.retry_s = timeout_s, retry_s
        self.waiting: deque[tuple[asyncio.Future[Any], float]] = deque()
        self.out: list[bytes] = []
        self.proto: _Protocol | None = None
        self.connecting: asyncio.Future[None] | None = None  # the connection attempt under way
        self.failed_at = float("-inf")
        self.scripts: dict[str, str] = {}  # sha -> source
        self._watch: asyncio.TimerHandle | None = None

    # -- connection ----------------------------------------------------------------------

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, proto = await asyncio.wait_for(loop.create_connection(lambda: _Protocol(self), self.host, self.port),
                                              self.timeout_s)
        except (OSError, TimeoutError) as e:
            self.failed_at = time.monotonic()
            raise ConnectionError(f"cannot reach Redis at {self.host}:{self.port}: {e}") from e
        self.proto = proto
        hello: list[bytes] = []
        if self.password is not None:
            hello.append(encode("AUTH", *([self.username] if self.username else []), self.password))
        if self.db:
            hello.append(encode("SELECT", self.db))
        hello += [encode("SCRIPT", "LOAD", source) for source in self.scripts.values()]  # (a new server has none)
        try:
            for cmd in hello:
                await self._send(cmd)
        except RedisError as e:  # a wrong password, a database that does not exist
            self._fail(ConnectionError(f"Redis at {self.host}:{self.port} refused the connection's setup: {e}"))
            raise ConnectionError(f"Redis at {self.host}:{self.port} refused the connection's setup: {e}") from e

    async def _ready(self) -> None:
        if self.proto is not None:
            return
        if self.connecting is None:
            if time.monotonic() - self.failed_at < self.retry_s:
                raise ConnectionError(f"Redis at {self.host}:{self.port} failed under {self.retry_s:.0f}s ago")
            self.connecting = asyncio.ensure_future(self._connect())
            self.connecting.add_done_callback(self._connected)
        await asyncio.shield(self.connecting)  # every caller waits for the same attempt

    def _connected(self, task: asyncio.Future[None]) -> None:
        self.connecting = None
        if not task.cancelled():
            task.exception()  # retrieved here; each waiter has it raised

    def _fail(self, e: Exception) -> None:
        """The connection is gone: every call in flight fails; the next one reconnects."""
        self.failed_at = time.monotonic()
        proto, self.proto = self.proto, None
        if proto is not None and proto.transport is not None:
            proto.transport.abort()
        while self.waiting:
            fut, _ = self.waiting.popleft()
            if not fut.done():
                fut.set_exception(e)
        self.out.clear()

    def _flush(self) -> None:
        if self.out and self.proto is not None and self.proto.transport is not None:
            self.proto.transport.write(b"".join(self.out))
        self.out.clear()

    def _check_timeouts(self) -> None:
        self._watch = None
        if self.waiting and time.monotonic() - self.waiting[0][1] > self.timeout_s:
            self._fail(ConnectionError(f"Redis at {self.host}:{self.port} did not answer within {self.timeout_s}s"))
        if self.waiting:
            self._watch = asyncio.get_running_loop().call_later(self.timeout_s / 4, self._check_timeouts)

    def _send(self, cmd: bytes) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self.waiting.append((fut, time.monotonic()))
        if not self.out:
            loop.call_soon(self._flush)  # whatever else this turn of the loop sends leaves with it
        self.out.append(cmd)
        if self._watch is None:
            self._watch = loop.call_later(self.timeout_s / 4, self._check_timeouts)
        return fut

    # -- calls ----------------------------------------------------------------------------

    async def call(self, *parts: bytes | str | int) -> Any:
        await self._ready()
        return await self._send(encode(*parts))

    def send(self, *parts: bytes | str | int) -> asyncio.Future[Any] | None:
        """Queue a command on the open connection without waiting for its reply (the future has it);
        None when no connection is open."""
        if self.proto is None:
            return None
        return self._send(encode(*parts))

    def script(self, source: str) -> str:
        sha = hashlib.sha1(source.encode()).hexdigest()
        self.scripts[sha] = source
        return sha

    async def evalsha(self, sha: str, keys: list[str], args: list[int | str]) -> Any:
        """Run a registered script; loaded again when Redis has forgotten it (a restart)."""
        try:
            return await self.call("EVALSHA", sha, len(keys), *keys, *args)
        except RedisError as e:
            if not str(e).startswith("NOSCRIPT"):
                raise
        await self.call("SCRIPT", "LOAD", self.scripts[sha])
        return await self.call("EVALSHA", sha, len(keys), *keys, *args)

    async def drain(self) -> None:
        """Wait for the replies of every command sent so far (those sent without waiting included)."""
        pending = [f for f, _ in self.waiting]
        if pending:
            await asyncio.wait(pending)

    async def aclose(self) -> None:
        """Close once what was sent has been answered (or has timed out)."""
        await self.drain()
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        self._fail(ConnectionError("client closed"))
