"""The direct relay: a stream's plain tokens written to the client from the worker connection's read.

Through the reader, each token of each stream costs the router a task switch and a frame of every
generator between the worker's connection and the client's response (`WorkerClient._generate_mux`,
`Dispatcher.run` and `_relay`, `Router._write_stream`) plus aiohttp's write path. On the multiplexed
worker stream a read carries one token for each of a step's streams, so that cost is paid per token per
stream. Here the connection's read callback hands a stream's plain tokens (no finish, logprobs or prefill
mode) to `Dispatcher`'s `direct_relay` (the attempt's load, the resume bookkeeping) and on to a
`DirectStream`, which counts them as `_write_stream` does and writes the same SSE bytes to the client's
transport. Everything else — the head, the first token, the finish and usage, logprobs, a failover's
replay, a client that does not keep up — goes through the reader as before; the two paths never
reorder a stream (a frame is offered only while the reader waits with nothing queued).

Taken only by streams of one choice whose text is written as it comes (no tool-call or reasoning parser,
no per-chunk usage); `--stream-relay queued` turns it off.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from aiohttp import hdrs, web

from router.api.sse import ChoiceWriter
from router.backends.http_client import chunk
from router.placement.dispatcher import Latency

# The transport's buffer beyond which tokens wait for the reader (which waits for the client to drain
# it, as aiohttp's own writes do past 64 KiB).
HIGH_WATER = 0x10000


class DirectStream:
    """One streamed choice's writer for the direct relay (`dispatcher.TokenWriter`)."""

    __slots__ = ("armed", "chunked", "latency", "reads", "relayed", "transport", "used", "writer")

    def __init__(self, writer: ChoiceWriter, latency: Latency, used: dict[str, int]):
        self.writer = writer
        self.latency = latency
        self.used = used
        self.transport: asyncio.Transport | None = None
        self.chunked = False
        self.armed = False  # the response head and everything before has been handed to the transport
        self.relayed = 0  # tokens that came this way (the request's log line says)
        self.reads = 0  # and the reads that brought them (an OpenAI upstream's carry text, no token ids)

    def attach(self, request: web.Request, resp: web.StreamResponse) -> None:
        """After `resp.prepare`: where to write, and whether aiohttp frames the body in chunks (HTTP/1.1)."""
        self.transport = request.transport
        self.chunked = resp.headers.get(hdrs.TRANSFER_ENCODING) == "chunked"

    def ready(self) -> bool:
        t = self.transport
        return self.armed and t is not None and not t.is_closing() and t.get_write_buffer_size() <= HIGH_WATER

    def tokens(self, text: str, token_ids: Sequence[int]) -> None:
        n = len(token_ids)
        self.latency.tokens(text, n)
        self.used["completion"] += n
        self.relayed += n
        self.reads += 1
        if text:
            data = self.writer.text(text)
            assert self.transport is not None  # (ready() said so)
            self.transport.write(chunk(data) if self.chunked else data)
