"""What the router sends to: one protocol, two implementations (splitfire workers over gRPC,
OpenAI-compatible servers over HTTP). Dispatch and health checks speak only this."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from router.api.chunks import Chunk
from router.core.affinity import Pin
from router.core.endpoints import Endpoint

if TYPE_CHECKING:
    from router.api.protocol import GenRequest


# A stream's plain tokens (text, token ids) taken as they arrive, outside the stream's reader: True when
# taken in full, False to have them yielded as a Chunk instead (router/dispatcher.py's direct relay).
TokenRelay = Callable[[str, Sequence[int]], bool]


@dataclass
class Route:
    decode: Endpoint  # decode, colocated or OpenAI upstream: where the stream comes from
    prefill: Endpoint | None  # None: the decode endpoint prefills itself

    def pin(self) -> Pin:
        return Pin(self.prefill.address if self.prefill else "", self.decode.address)

    def endpoints(self) -> tuple[Endpoint, ...]:
        return (self.decode,) if self.prefill is None else (self.decode, self.prefill)


@dataclass
class Probe:
    """A health check's answer."""

    ok: bool
    block_size: int = 0  # workers: their KV block size (0: not reported)
    max_model_len: int = 0
    stream_port: int = 0  # workers: the HTTP port serving their token stream (0: gRPC only)
    stream_mux: bool = False  # workers: that port also serves all streams on one connection
    adapters: list[str] = field(default_factory=list)  # workers: LoRA adapters resident
    adapter_models: list[str] = field(default_factory=list)  # workers hosting several models: each one's base
    # workers: (prompt tokens in flight, KV tokens held, decode tokens remaining), for reconciliation
    load: tuple[int, int, int] | None = None
    models: list[str] = field(default_factory=list)  # upstreams: what /v1/models lists
    model: str = ""  # workers: the name of the model directory they serve
    hosted: list[str] = field(default_factory=list)  # workers hosting several base models: all of them
    resident: list[str] = field(default_factory=list)  # ... and those loaded now


class Backend(Protocol):
    # The stream carries token ids: the router counts the output itself, and a stream cut off
    # mid-way can be resumed on another endpoint (prompt + tokens so far). Otherwise only a
    # request that produced nothing yet can move.
    token_level: bool

    def generate(self, route: Route, req: GenRequest, generated: list[int], max_tokens: int, attempt: int,
                 timeout_s: float, relay: TokenRelay | None = None) -> AsyncIterator[Chunk]:
        """The stream of one attempt. `relay`: a backend that can hand plain tokens over as they arrive
        does so (the multiplexed worker stream); one that cannot yields everything as Chunks."""
        ...

    async def probe(self, ep: Endpoint, timeout_s: float) -> Probe: ...

    async def reset_prefix_cache(self, ep: Endpoint, timeout_s: float) -> str:
        """Make the endpoint forget its cached prefixes; returns what it said (raises on failure)."""
        ...

    async def close(self) -> None: ...


class Backends:
    """The backend that speaks to an endpoint, by the endpoint's kind."""

    def __init__(self, workers: Backend, upstreams: Backend):
        self.workers = workers
        self.upstreams = upstreams

    def of(self, ep: Endpoint) -> Backend:
        return self.upstreams if ep.role == "openai" else self.workers

    async def close(self) -> None:
        await self.workers.close()
        await self.upstreams.close()
