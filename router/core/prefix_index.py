"""An approximate map of which prompt blocks each endpoint has cached (by `common.block_hash`,
the hashes the workers' own prefix caches use).

The router remembers the tenant-scoped, chained block hashes it sent to each endpoint
(bounded LRU per endpoint). It never asks the workers: a miss costs only a slightly
worse placement, never a wrong answer.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

# Fetching a block from the workers' shared KV store costs about this fraction of computing it
# (bench_kvtransfer's store row: a 2,048-token prefix fetched >= 5x faster than recomputed).
STORE_HIT_COST = 0.2
_FLEET = ""  # the map of blocks sent anywhere: what the shared KV store has likely seen


class PrefixLookup(Protocol):
    """What placement asks of an index: this approximate one, or the exact one built from the workers'
    KV events (`router/kv_events.py`)."""

    @property
    def shared_store(self) -> bool: ...

    def cached_tokens(self, endpoint: str, hashes: list[bytes], max_blocks: int, block_size: int) -> int: ...

    def matched_blocks(self, endpoint: str, hashes: list[bytes]) -> int: ...

    def insert(self, endpoint: str, hashes: list[bytes]) -> None: ...

    def clear(self) -> None: ...


class PrefixIndex:
    def __init__(self, capacity_per_endpoint: int, shared_store: bool = False):
        self.capacity = capacity_per_endpoint
        self.shared_store = shared_store
        self._maps: dict[str, OrderedDict[bytes, None]] = {}

    def cached_tokens(self, endpoint: str, hashes: list[bytes], max_blocks: int, block_size: int) -> int:
        """Expected prompt tokens `endpoint` will not compute: its own cache hit in full, and with a
        shared KV store, blocks seen anywhere in the fleet at a discount (they cost a fetch)."""
        local = min(self.matched_blocks(endpoint, hashes), max_blocks)
        if not self.shared_store:
            return local * block_size
        fleet = min(self.matched_blocks(_FLEET, hashes), max_blocks)
        return int((local + (1 - STORE_HIT_COST) * max(fleet - local, 0)) * block_size)

    def matched_blocks(self, endpoint: str, hashes: list[bytes]) -> int:
        m = self._maps.get(endpoint)
        if not m:
            return 0
        n = 0
        for h in hashes:
            if h not in m:
                break
            n += 1
        return n

    def clear(self) -> None:
        self._maps.clear()

    def insert(self, endpoint: str, hashes: list[bytes]) -> None:
        self._insert(endpoint, hashes)
        if self.shared_store:
            self._insert(_FLEET, hashes)

    def _insert(self, endpoint: str, hashes: list[bytes]) -> None:
        m = self._maps.setdefault(endpoint, OrderedDict())
        for h in hashes:
            if h in m:
                m.move_to_end(h)
            else:
                m[h] = None
        while len(m) > self.capacity:
            m.popitem(last=False)
