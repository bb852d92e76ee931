"""Block identities shared across processes: a full block's hash is chained from its parent's
(so it commits to every token before it) and rooted at the tenant and LoRA adapter (`cache_scope`:
two tenants, or two adapters, never share a block). The engine's prefix cache, the KV store's keys and the router's prefix-aware placement
all use this one function; torch-free, so the router can import it.
"""

from __future__ import annotations

import hashlib
from array import array

HASH_BYTES = 16
# A KV event (worker/kv/events.py → router/kv_events.py): b"+" (stored) or b"-" (evicted), then the hash.
KV_EVENT_BYTES = 1 + HASH_BYTES


def cache_scope(tenant: str, adapter: str = "") -> str:
    """What a prompt's KV is shared within: its tenant, and the LoRA adapter it runs under (the same
    tokens under two adapters have different K/V)."""
    return f"{tenant}\x00adapter:{adapter}" if adapter else tenant


def tenant_root(tenant: str) -> bytes:
    return hashlib.blake2b(b"splitfire/tenant:" + tenant.encode(), digest_size=HASH_BYTES).digest()


def chain_hash(parent: bytes, tokens: list[int]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=HASH_BYTES)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def block_hashes(tenant: str, token_ids: list[int], block_size: int, start: int = 0,
                 parent: bytes | None = None) -> list[bytes]:
    """Chained hashes of the full blocks of `token_ids`, from block `start` (whose parent is given)."""
    out: list[bytes] = []
    h = parent if parent is not None else tenant_root(tenant)
    for i in range(start, len(token_ids) // block_size):
        h = chain_hash(h, token_ids[i * block_size : (i + 1) * block_size])
        out.append(h)
    return out
