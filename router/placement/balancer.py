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

from router.core.endpoints import Endpoint


@dataclass
class Placement:
    prompt_tokens: int
    cached_tokens: Callable[[Endpoint], int]  # expected prefix-cache hit on an endpoint


class Policy(Protocol):
    name: str

    def pick(self, candidates: list[Endpoint], placement: Placement) -> Endpoint: ...

    def pick_route(self, decodes: list[Endpoint], prefills: list[Endpoint],
                   placement: Placement) -> tuple[Endpoint, Endpoint | None]:
        """The decode (or colocated) endpoint, and a prefill endpoint when it is a decode worker."""
        ...


class _Independent:
    """Decode and prefill endpoints chosen one after the other by the same rule."""

    def pick(self, candidates: list[Endpoint], placement: Placement) -> Endpoint:
        raise NotImplementedError

    def pick_route(self, decodes: list[Endpoint], prefills: list[Endpoint],
                   placement: Placement) -> tuple[Endpoint, Endpoint | None]:
        d = self.pick(decodes, placement)
        return d, (self.pick(prefills, placement) if prefills and d.role == "decode" else None)


def token_cost(ep: Endpoint, placement: Placement) -> int:
    return ep.load() + placement.prompt_tokens - placement.cached_tokens(ep)


class TokenPolicy(_Independent):
    name = "token"

    def pick(self, candidates: list[Endpoint], placement: Placement) -> Endpoint:
        return min(candidates, key=lambda e: (token_cost(e, placement), e.active, e.address))


class RoundRobinPolicy:
    """Every endpoint in turn; in disaggregated mode every (prefill, decode) pair in turn: the
    prefill endpoint advances each time the decode endpoints have all had one (two counters
    moving together would pin each decode worker to one prefill worker)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, candidates: list[Endpoint], placement: Placement) -> Endpoint:
        ordered = sorted(candidates, key=lambda e: e.address)
        return ordered[next(self._counter) % len(ordered)]

    def pick_route(self, decodes: list[Endpoint], prefills: list[Endpoint],
                   placement: Placement) -> tuple[Endpoint, Endpoint | None]:
        ds = sorted(decodes, key=lambda e: e.address)
        i = next(self._counter)
        d = ds[i % len(ds)]
        if not prefills or d.role != "decode":
            return d, None
        ps = sorted(prefills, key=lambda e: e.address)
        return d, ps[(i // len(ds)) % len(ps)]


class RandomPolicy(_Independent):
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def pick(self, candidates: list[Endpoint], placement: Placement) -> Endpoint:
        return self._rng.choice(candidates)


def make_policy(name: str) -> Policy:
    policies: dict[str, Callable[[], Policy]] = {"token": TokenPolicy, "round_robin": RoundRobinPolicy,
                                                 "random": RandomPolicy}
    return policies[name]()
