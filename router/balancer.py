"""Load-balancing policies: small interchangeable units behind one `pick`.

The `token` policy's cost of placing a request on endpoint e (lower is better):

    prefill:    load(e) + uncached(e)
    decode:     load(e) + uncached(e)
    colocated:  load(e) + uncached(e)

where load(e) is e's estimated tokens in flight (see `endpoints.py`: uncached prompt
tokens queued or running for prefill; KV tokens held plus expected remaining output
for decode) and uncached(e) = prompt tokens − tokens e is expected to hold already
(`prefix_index.py`). A warm cache therefore wins only while its saving exceeds the
extra load, so a shared system prompt does not pile every request onto one endpoint.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from router.endpoints import Endpoint


@dataclass
class Placement:
    prompt_tokens: int
    cached_tokens: Callable[[Endpoint], int]  # expected prefix-cache hit on an endpoint


class Policy(Protocol):
    name: str

    def pick(self, candidates: list[Endpoint], placement: Placement) -> Endpoint: ...


def token_cost(ep: Endpoint, placement: Placement) -> int:
    return ep.load() + placement.prompt_tokens - placement.cached_tokens(ep)


class TokenPolicy:
    name = "token"

    def pick(self, candidates: list[Endpoint], placement: Placement) -> Endpoint:
        return min(candidates, key=lambda e: (token_cost(e, placement), e.active, e.address))


class RoundRobinPolicy:
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, candidates: list[Endpoint], placement: Placement) -> Endpoint:
        ordered = sorted(candidates, key=lambda e: e.address)
        return ordered[next(self._counter) % len(ordered)]


class RandomPolicy:
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def pick(self, candidates: list[Endpoint], placement: Placement) -> Endpoint:
        return self._rng.choice(candidates)


def make_policy(name: str) -> Policy:
    return {"token": TokenPolicy, "round_robin": RoundRobinPolicy, "random": RandomPolicy}[name]()
