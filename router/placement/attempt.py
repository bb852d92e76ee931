"""One try of a request on one route: its share of the endpoints' load estimates, what it tells
the prefix index, and what it tells the endpoints' circuit breakers.

Load moves as the request does: the prefilling endpoint carries the uncached prompt tokens
until the first token; the decode endpoint holds the prompt's KV and the output still to come.
A decode worker that prefills locally says so before it starts (`prefill_mode`), and the
prefill charge moves to it at once: the prefill endpoint is then left with nothing.
"""

from __future__ import annotations

from router.backends.backend import Backend, Route
from router.core.endpoints import Endpoint, EndpointRegistry
from router.core.prefix_index import PrefixLookup


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


class Attempt:
    def __init__(self, number: int, route: Route, backend: Backend, registry: EndpointRegistry,
                 index: PrefixLookup, hashes: list[bytes], prompt_tokens: int, resumed_tokens: int, max_tokens: int):
        self.number = number
        self.route = route
        self.backend = backend
        self.registry = registry
        self.index = index
        self.hashes = hashes
        self.max_tokens = max_tokens
        bs = registry.block_size
        prefiller = route.prefill or route.decode
        cached = index.cached_tokens(prefiller.address, hashes, (prompt_tokens - 1) // bs, bs) if hashes else 0
        self.ticket = Ticket(route, prompt_tokens + resumed_tokens, prompt_tokens - cached, max_tokens)
        self.mode_seen = False
        self.served = False  # the endpoints produced output: a success for their breakers
        self.blamed = False
        self.probes = [ep for ep in route.endpoints() if registry.on_attempt(ep)]  # half-open slots it holds
        if hashes:  # the decode side holds the prompt's blocks either way; the prefill side only
            index.insert(route.decode.address, hashes)  # if the decode worker sends it the prompt

    def on_prefill_mode(self, mode: str) -> None:
        if self.mode_seen or self.route.prefill is None:
            return
        self.mode_seen = True
        if mode == "remote":
            if self.hashes:
                self.index.insert(self.route.prefill.address, self.hashes)
        elif mode == "local":
            self.ticket.prefilled_locally()

    def on_output(self, n_tokens: int) -> None:
        self.ticket.on_tokens(n_tokens)
        if not self.served:
            self.served = True
            for ep in self.route.endpoints():
                if ep is self.route.decode or self.ticket.prefiller is ep:
                    self.registry.on_success(ep)

    def blame(self, ep: Endpoint, why: str) -> None:
        self.blamed = True
        self.registry.on_failure(ep, why)

    def close(self) -> None:
        self.ticket.close()
        if not self.served and not self.blamed:  # abandoned (client gone, or not the endpoints' fault)
            for ep in self.probes:
                ep.breaker.release_probe()
