"""An approximate map of which prompt blocks each endpoint has cached.

The router remembers the tenant-scoped, chained block hashes it sent to each endpoint
(bounded LRU per endpoint). It never asks the workers: a miss costs only a slightly
worse placement, never a wrong answer.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict


def prompt_block_hashes(tenant: str, token_ids: list[int], block_size: int) -> list[bytes]:
    h = hashlib.blake2b(b"splitfire/tenant:" + tenant.encode(), digest_size=16).digest()
    out = []
    for i in range(len(token_ids) // block_size):
        d = hashlib.blake2b(h, digest_size=16)
        d.update(array("q", token_ids[i * block_size : (i + 1) * block_size]).tobytes())
        h = d.digest()
        out.append(h)
    return out


class PrefixIndex:
    def __init__(self, capacity_per_endpoint: int):
        self.capacity = capacity_per_endpoint
        self._maps: dict[str, OrderedDict[bytes, None]] = {}

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

    def insert(self, endpoint: str, hashes: list[bytes]) -> None:
        m = self._maps.setdefault(endpoint, OrderedDict())
        for h in hashes:
            if h in m:
                m.move_to_end(h)
            else:
                m[h] = None
        while len(m) > self.capacity:
            m.popitem(last=False)
