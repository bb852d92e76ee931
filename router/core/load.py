"""Tokens in flight per endpoint, and a request's share of them: all of the router's load accounting.

Each endpoint's estimate is kept locally (charged on dispatch, per streamed token, on completion) and
reconciled with the worker's own `Stats`, which also count other routers' requests:

    load = max(local, reported + (local - local_when_reported))

Load moves as the request does (`Ticket`): the prefilling endpoint carries the uncached prompt tokens
until the first token; the decode endpoint holds the prompt's KV and the output still to come. A decode
worker that prefills locally says so before it starts (`prefill_mode`), and the prefill charge moves to
it at once: the prefill endpoint is then left with nothing. Every change goes through `charge`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(eq=False, kw_only=True)
class EndpointLoad:
    """An endpoint's load estimate (`Endpoint` is one)."""

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

    def load(self) -> int:
        return self.prefill_load() + self.decode_load()

    def prefill_load(self) -> int:
        local = self.prefill_tokens
        return max(local, self.reported_prefill + local - self.local_prefill_at_report)

    def decode_load(self) -> int:
        local = self.held_tokens + self.remaining_tokens
        return max(local, self.reported_decode + local - self.local_decode_at_report)

    def reconcile(self, prompt_tokens_in_flight: int, kv_tokens_held: int, decode_tokens_remaining: int) -> None:
        self.reported_prefill = prompt_tokens_in_flight
        self.reported_decode = kv_tokens_held + decode_tokens_remaining
        self.local_prefill_at_report = self.prefill_tokens
        self.local_decode_at_report = self.held_tokens + self.remaining_tokens


class Route(Protocol):
    """The endpoints of one attempt (`backends.backend.Route`): the stream's source, and who prefills."""

    @property
    def decode(self) -> EndpointLoad: ...

    @property
    def prefill(self) -> EndpointLoad | None: ...


class Ticket:
    """An attempt's contribution to the endpoints' in-flight token estimates."""

    def __init__(self, route: Route, prompt_tokens: int, uncached: int, max_tokens: int):
        self.route = route
        self.prefiller = route.prefill or route.decode
        self.uncached = uncached
        self.held = prompt_tokens
        self.remaining = max_tokens
        self.prefilling = True
        self.closed = False
        self.prefiller.charge(uncached, 0, 0, 0)
        route.decode.charge(0, prompt_tokens, max_tokens, 1)
        if route.prefill is not None:
            route.prefill.charge(0, 0, 0, 1)

    def prefilled_locally(self) -> None:
        """The decode worker computes the prompt itself: the prefill endpoint gets none of it."""
        p = self.route.prefill
        if p is None or not self.prefilling or self.prefiller is not p:
            return
        p.charge(-self.uncached, 0, 0, -1)
        self.prefiller = self.route.decode
        self.prefiller.charge(self.uncached, 0, 0, 0)

    def on_tokens(self, n: int) -> None:
        if self.prefilling:
            self.prefilling = False
            self.prefiller.charge(-self.uncached, 0, 0, 0)
            if self.route.prefill is not None and self.prefiller is self.route.prefill:
                self.route.prefill.charge(0, 0, 0, -1)
        n = min(n, self.remaining)
        self.route.decode.charge(0, n, -n, 0)
        self.held += n
        self.remaining -= n

    def close(self) -> None:
        """Idempotent: runs on completion, on failure and when the client goes away."""
        if self.closed:
            return
        self.closed = True
        if self.prefilling:
            self.on_tokens(0)
        self.route.decode.charge(0, -self.held, -self.remaining, -1)
        self.held = self.remaining = 0
