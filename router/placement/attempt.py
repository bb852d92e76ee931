"""One try of a request on one route: its share of the endpoints' load estimates (a `core.load.Ticket`),
what it tells the prefix index, and what it tells the endpoints' circuit breakers."""

from __future__ import annotations

from typing import Any

from router.backends.backend import Backend, Route
from router.core.endpoints import Endpoint, EndpointRegistry
from router.core.load import Ticket
from router.core.prefix_index import PrefixLookup


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
        self.prefill_mode = ""  # remote | local | colocated, as the decode worker said
        self.span: Any = None  # its trace span (common/tracing.py), while open
        self.served = False  # the endpoints produced output: a success for their breakers
        self.blamed = False
        self.probes = [ep for ep in route.endpoints() if registry.on_attempt(ep)]  # half-open slots it holds
        if hashes:  # the decode side holds the prompt's blocks either way; the prefill side only
            index.insert(route.decode.address, hashes)  # if the decode worker sends it the prompt

    def on_prefill_mode(self, mode: str) -> None:
        if self.mode_seen or self.route.prefill is None:
            self.prefill_mode = self.prefill_mode or mode
            return
        self.mode_seen = True
        self.prefill_mode = mode
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
