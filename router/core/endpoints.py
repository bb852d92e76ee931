"""Endpoints the router can send to: what each is and serves, its health (a circuit breaker), and the
tokens it has in flight (`load.EndpointLoad`, where all load accounting lives)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from router.core.breaker import OPEN, BreakerConfig, CircuitBreaker
from router.core.load import EndpointLoad

log = logging.getLogger("splitfire.router")

ROLES = ("prefill", "decode", "colocated", "openai")


@dataclass(eq=False)
class Endpoint(EndpointLoad):
    address: str  # host:port for workers, base URL for OpenAI-compatible upstreams
    role: str
    source: str = "static"  # static | redis | dns
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)  # optimistic (closed) until it fails
    last_seen: float = field(default_factory=time.monotonic)
    block_size: int = 16
    max_model_len: int = 0
    stream_port: int = 0  # workers: their HTTP port serving the token stream (0: gRPC only)
    stream_mux: bool = False  # workers: that port also serves all streams on one connection
    adapters: set[str] = field(default_factory=set)  # workers: LoRA adapters resident (from health checks)
    # workers hosting several base models: each adapter's base (model directory name); absent: served_model's
    adapter_models: dict[str, str] = field(default_factory=dict)
    models: set[str] = field(default_factory=set)  # OpenAI upstreams: what their /v1/models lists
    served_model: str = ""  # workers: the model directory's name they report (a router serving several models)
    # workers hosting several base models (--on-demand-model): every one they serve, and those loaded now
    hosted: set[str] = field(default_factory=set)
    resident: set[str] = field(default_factory=set)

    def serves(self, model: str) -> bool:
        """Whether this worker serves base model `model` (its directory's name), loaded or on demand."""
        return model == self.served_model or model in self.hosted

    def holds(self, model: str) -> bool:
        """Whether `model` is loaded here now (a worker serving one model always holds it)."""
        return model == self.served_model if not self.hosted else model in self.resident

    @property
    def healthy(self) -> bool:
        return self.breaker.state != OPEN

    def load(self) -> int:
        """What placement weighs: the prefill part, the decode part, or both (`load.EndpointLoad`)."""
        if self.role == "prefill":
            return self.prefill_load()
        if self.role == "decode":
            return self.decode_load()
        return self.prefill_load() + self.decode_load()


class EndpointRegistry:
    def __init__(self, block_size: int = 16, breaker: BreakerConfig | None = None) -> None:
        self.by_address: dict[tuple[str, str], Endpoint] = {}
        self.breaker = breaker or BreakerConfig()
        # The fleet's KV block size, as its workers report it (prompt block hashes must match the
        # workers' own); until one reports, the router's default.
        self.block_size = block_size
        self.block_size_learned = False

    def admit_block_size(self, ep: Endpoint, block_size: int) -> bool:
        """A worker's reported block size: the first sets the fleet's; one that differs is refused
        (mixing them would make every prefix-aware placement guess wrong)."""
        if not self.block_size_learned:
            self.block_size, self.block_size_learned = block_size, True
            return True
        if block_size != self.block_size:
            log.error("event=endpoint_refused role=%s address=%s reason=block_size reported=%d fleet=%d",
                      ep.role, ep.address, block_size, self.block_size)
            return False
        return True

    def add(self, address: str, role: str, source: str = "static") -> Endpoint:
        key = (role, address)
        ep = self.by_address.get(key)
        if ep is None:
            ep = self.by_address[key] = Endpoint(address, role, source, CircuitBreaker(self.breaker))
            log.info("event=endpoint_added role=%s address=%s source=%s", role, address, source)
        ep.last_seen = time.monotonic()
        return ep

    def sync(self, role: str, source: str, addresses: set[str]) -> None:
        """Make the endpoints of (role, source) exactly `addresses` (dynamic discovery)."""
        for a in addresses:
            self.add(a, role, source)
        for key, ep in list(self.by_address.items()):
            if ep.role == role and ep.source == source and ep.address not in addresses and ep.active == 0:
                del self.by_address[key]
                log.info("event=endpoint_removed role=%s address=%s source=%s", role, ep.address, source)

    def all(self) -> list[Endpoint]:
        return list(self.by_address.values())

    def get(self, role: str, address: str) -> Endpoint | None:
        return self.by_address.get((role, address))

    def healthy(self, role: str, exclude: frozenset[str] | set[str] = frozenset()) -> list[Endpoint]:
        """The endpoints of `role` a new request may go to (closed breakers, and half-open ones
        with no probe in flight); when every one is probing, those: the fleet is what it is.
        `exclude` (endpoints this request already failed on) is applied first: a retry whose only
        closed endpoint just failed goes to a half-open one that is probing rather than nowhere."""
        eps = [e for e in self.by_address.values() if e.role == role and e.address not in exclude]
        now = time.monotonic()
        ok = [e for e in eps if e.breaker.available(now)]
        return ok or [e for e in eps if e.healthy]

    def on_attempt(self, ep: Endpoint) -> bool:
        return ep.breaker.on_attempt()

    def on_success(self, ep: Endpoint) -> None:
        if ep.breaker.on_success():
            log.info("event=endpoint_readmitted role=%s address=%s via=probe_request", ep.role, ep.address)

    def on_failure(self, ep: Endpoint, why: str) -> None:
        if ep.breaker.on_failure():
            b = ep.breaker
            log.warning("event=endpoint_ejected role=%s address=%s reason=requests open_s=%.1f "
                        "recent_errors=%d/%d error=%r", ep.role, ep.address, b.open_for, sum(b.outcomes),
                        len(b.outcomes), why)

    def on_check(self, ep: Endpoint, ok: bool) -> None:
        changed = ep.breaker.on_check(ok)
        if changed == "opened":
            log.warning("event=endpoint_ejected role=%s address=%s reason=health_check", ep.role, ep.address)
        elif changed == "half_open":
            log.info("event=endpoint_half_open role=%s address=%s via=health_check", ep.role, ep.address)
