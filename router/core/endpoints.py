"""Endpoints the router can send to, their health, and the tokens each has in flight.

Load is estimated locally (updated on dispatch, per streamed token, on completion) and
reconciled with the workers' own `Stats`, which also count other routers' requests:

    load = max(local, reported + (local - local_when_reported))
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from router.core.breaker import OPEN, BreakerConfig, CircuitBreaker

log = logging.getLogger("splitfire.router")

ROLES = ("prefill", "decode", "colocated", "openai")


@dataclass(eq=False)
class Endpoint:
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
    # local estimates
    prefill_tokens: int = 0  # uncached prompt tokens sent here and not yet prefilled
    held_tokens: int = 0  # KV tokens our running requests hold here (decode / colocated)
    remaining_tokens: int = 0  # output tokens our running requests may still produce here
    active: int = 0  # requests in flight
    peak_load: int = 0
    # the worker's own view, and our local load when we read it
    reported_prefill: int = 0
    reported_decode: int = 0
    local_prefill_at_report: int = 0
    local_decode_at_report: int = 0

    def serves(self, model: str) -> bool:
        """Whether this worker serves base model `model` (its directory's name), loaded or on demand."""
        return model == self.served_model or model in self.hosted

    def holds(self, model: str) -> bool:
        """Whether `model` is loaded here now (a worker serving one model always holds it)."""
        return model == self.served_model if not self.hosted else model in self.resident

    @property
    def healthy(self) -> bool:
        return self.breaker.state != OPEN

    # -- the local estimates change only here -------------------------------------------

    def charge(self, prefill_tokens: int, held_tokens: int, remaining_tokens: int, active: int) -> None:
        """Add (or with negative numbers, take back) a request's share of this endpoint's load."""
        self.prefill_tokens += prefill_tokens
        self.held_tokens += held_tokens
        self.remaining_tokens += remaining_tokens
        self.active += active
        # The load can only have grown if the prefill part or the decode part did (a decoded token moves
        # one from remaining to held: no change, so the peak is not recomputed per token).
        if prefill_tokens > 0 or held_tokens + remaining_tokens > 0:
            self.peak_load = max(self.peak_load, self.load())

    def prefill_load(self) -> int:
        local = self.prefill_tokens
        return max(local, self.reported_prefill + local - self.local_prefill_at_report)

    def decode_load(self) -> int:
        local = self.held_tokens + self.remaining_tokens
        return max(local, self.reported_decode + local - self.local_decode_at_report)

    def load(self) -> int:
        if self.role == "prefill":
            return self.prefill_load()
        if self.role == "decode":
            return self.decode_load()
        return self.prefill_load() + self.decode_load()

    def reconcile(self, prompt_tokens_in_flight: int, kv_tokens_held: int, decode_tokens_remaining: int) -> None:
        self.reported_prefill = prompt_tokens_in_flight
        self.reported_decode = kv_tokens_held + decode_tokens_remaining
        self.local_prefill_at_report = self.prefill_tokens
        self.local_decode_at_report = self.held_tokens + self.remaining_tokens


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
