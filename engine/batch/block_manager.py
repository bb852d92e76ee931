"""Block allocation, reference counts and the tenant-scoped prefix cache.

A full block's identity is a hash chained from its parent's, rooted at the tenant, so
two tenants never resolve to the same block even for identical prompts. Blocks nobody
references but whose contents are known stay in an LRU and are reclaimed on demand.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from common.block_hash import block_hashes
from engine.batch.free_extents import FreeExtents
from engine.batch.sequence import Sequence


@dataclass
class BlockStats:
    total: int
    used: int  # referenced by a live sequence
    cached: int  # unreferenced but reusable by prefix hits
    free: int  # unreferenced and empty
    prefix_query_tokens: int
    prefix_hit_tokens: int

    @property
    def prefix_hit_ratio(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        self.free = FreeExtents(num_blocks)  # empty, unreferenced blocks, as runs of consecutive ids
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        # KV events (router/kv_events.py builds an exact index from them): every hash entering or
        # leaving the prefix cache, numbered; None until someone listens (`enable_kv_events`).
        self.kv_events: bytearray | None = None
        self.kv_event_seq = 0

    # -- KV events --------------------------------------------------------------------

    def enable_kv_events(self) -> None:
        if self.kv_events is None:
            self.kv_events = bytearray()

    def _kv_event(self, op: bytes, h: bytes) -> None:
        if self.kv_events is not None:
            self.kv_events += op
            self.kv_events += h
            self.kv_event_seq += 1

    def take_kv_events(self) -> tuple[int, bytes]:
        """(the last event's number, the events since the last take: b"+" or b"-" and a 16-byte hash each)."""
        assert self.kv_events is not None
        out = bytes(self.kv_events)
        self.kv_events.clear()
        return self.kv_event_seq, out

    def kv_snapshot(self) -> tuple[int, list[bytes]]:
        """(the last event's number, every hash the prefix cache holds now): what a listener starts from."""
        return self.kv_event_seq, list(self.hash_to_block)

    # -- capacity -------------------------------------------------------------------

    @property
    def num_available(self) -> int:
        return len(self.free) + len(self.lru)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def stats(self) -> BlockStats:
        free, cached = len(self.free), len(self.lru)
        return BlockStats(
            total=self.num_blocks,
            used=self.num_blocks - free - cached,
            cached=cached,
            free=free,
            prefix_query_tokens=self.prefix_query_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens,
        )

    # -- allocation -------------------------------------------------------------------

    def _evict(self, b: int) -> None:
        """Drop cached block b's contents and make it free."""
        del self.lru[b]
        h = self.block_hash[b]
        if h is not None and self.hash_to_block.get(h) == b:
            del self.hash_to_block[h]
            self._kv_event(b"-", h)
        self.block_hash[b] = None
        self.free.add(b)

    def reset_prefix_cache(self) -> tuple[int, int]:
        """Forget every cached prefix: unreferenced cached blocks become free, blocks that running
        requests hold stop being offered to others. Returns (freed, unshared)."""
        freed = len(self.lru)
        for b in list(self.lru):
            self._evict(b)
        unshared = 0
        for b, h in enumerate(self.block_hash):
            if h is not None:
                if self.hash_to_block.get(h) == b:
                    del self.hash_to_block[h]
                    self._kv_event(b"-", h)
                self.block_hash[b] = None
                unshared += 1
        return freed, unshared

    def _evict_runs(self, need: int) -> None:
        """Free `need` cached blocks: the oldest first, each together with the cached blocks next to it
        (usually the rest of the same finished request, freed at the same time), so the freed blocks
        form runs and the allocation that needed them stays contiguous."""
        while need > 0:
            oldest = next(iter(self.lru))
            self._evict(oldest)
            need -= 1
            for step in (1, -1):
                b = oldest + step
                while need > 0 and b in self.lru:
                    self._evict(b)
                    need -= 1
                    b += step

    def _take_new(self, n: int, after: int | None = None) -> list[int]:
        """n empty blocks, as few runs as possible: cached blocks are evicted in runs when the free ones
        do not suffice, then the longest free runs are taken. With `after`, block `after + 1` goes
        first when free, so a growing sequence stays contiguous."""
        out: list[int] = []
        if after is not None and n and self.free.take_after(after):
            out.append(after + 1)
        self._evict_runs(n - len(out) - len(self.free))
        out += self.free.take(n - len(out))
        for b in out:
            self.ref_counts[b] = 1
        return out

    def _take_cached(self, b: int) -> None:
        if self.ref_counts[b] == 0:
            del self.lru[b]
        self.ref_counts[b] += 1

    def match_prefix(self, hashes: list[bytes]) -> list[int]:
        """Blocks holding the longest cached prefix of `hashes` (no references taken)."""
        hits: list[int] = []
        if not self.enable_prefix_cache:
            return hits
        for h in hashes:
            b = self.hash_to_block.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def _ensure_hashes(self, seq: Sequence) -> None:
        tokens = seq.all_token_ids
        if len(seq.block_hashes) < len(tokens) // self.block_size:
            seq.block_hashes = block_hashes(seq.scope, tokens, self.block_size)

    def first_uncached(self, seq: Sequence) -> bytes | None:
        """The hash of the first block of a waiting `seq` that the cache cannot serve (None: all
        of its reusable prefix is cached)."""
        if not self.enable_prefix_cache:
            return None
        self._ensure_hashes(seq)
        hashes = seq.block_hashes[: (seq.num_tokens - 1) // self.block_size]
        for h in hashes:
            if h not in self.hash_to_block:
                return h
        return None

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Give a block-less `seq` blocks for its first `num_tokens` tokens, reusing cached prefix blocks.

        At least one token is always left to compute (its logits are needed), so a fully
        cached prompt still recomputes its last block. Returns False, changing nothing,
        when there are not enough blocks.
        """
        assert not seq.block_table, f"{seq.request_id} already holds blocks"
        tokens = seq.all_token_ids
        self._ensure_hashes(seq)
        max_hits = (len(tokens) - 1) // self.block_size
        hits = self.match_prefix(seq.block_hashes[:max_hits])
        hits_in_lru = sum(1 for b in hits if self.ref_counts[b] == 0)
        needed = self.blocks_for(num_tokens) - len(hits)
        if needed > self.num_available - hits_in_lru:
            return False
        for b in hits:
            self._take_cached(b)
        seq.block_table = hits + self._take_new(max(needed, 0), after=hits[-1] if hits else None)
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_registered_blocks = len(hits)
        self.prefix_query_tokens += len(tokens)
        self.prefix_hit_tokens += seq.num_cached_tokens
        return True

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make `seq`'s block table cover `num_tokens` tokens. False (no change) if blocks ran out."""
        needed = self.blocks_for(num_tokens) - len(seq.block_table)
        if needed <= 0:
            return True
        if needed > self.num_available:
            return False
        seq.block_table.extend(self._take_new(needed, after=seq.block_table[-1] if seq.block_table else None))
        return True

    def mark_computed(self, seq: Sequence, num_tokens: int) -> None:
        """The next `num_tokens` of `seq` have their K/V in its blocks: count them, and enter the blocks
        that became full into the prefix cache (so they stay cached when the sequence is freed)."""
        seq.num_computed_tokens += num_tokens
        self.register_computed(seq)

    def register_computed(self, seq: Sequence) -> None:
        """Enter `seq`'s newly completed full blocks into the prefix cache."""
        if not self.enable_prefix_cache:
            return
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        if full <= seq.num_registered_blocks:
            return
        if len(seq.block_hashes) < full:
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.extend(
                block_hashes(seq.scope, seq.all_token_ids[: full * self.block_size], self.block_size,
                             start=len(seq.block_hashes), parent=parent)
            )
        for i in range(seq.num_registered_blocks, full):
            b, h = seq.block_table[i], seq.block_hashes[i]
            if self.block_hash[b] is None and h not in self.hash_to_block:
                self.block_hash[b] = h
                self.hash_to_block[h] = b
                self._kv_event(b"+", h)
        seq.num_registered_blocks = full

    def _drop_ref(self, b: int, holder: str) -> None:
        """`holder` lets go of block `b`; the last reference sends a cached block to the LRU, any other
        to the free set."""
        self.ref_counts[b] -= 1
        assert self.ref_counts[b] >= 0, f"block {b} released twice ({holder})"
        if self.ref_counts[b] == 0:
            if self.block_hash[b] is not None:
                self.lru[b] = None
            else:
                self.free.add(b)

    def pin(self, blocks: list[int]) -> None:
        """Take an extra reference (a copy of the blocks is being read out, e.g. published to the
        cluster-wide KV store): they cannot be reused until `unpin`."""
        for b in blocks:
            self._take_cached(b)

    def unpin(self, blocks: list[int]) -> None:
        for b in blocks:
            self._drop_ref(b, "a pin")

    def take_landing(self, seq: Sequence, first: int) -> bool:
        """Spare blocks for `seq.block_table[first:]` to land in (`Sequence.landing`), as few runs as the
        free blocks allow; False (nothing taken) when fewer are available."""
        n = len(seq.block_table) - first
        if n <= 0 or self.num_available < n:
            return False
        seq.landing, seq.landing_from = self._take_new(n), first
        return True

    def free_landing(self, seq: Sequence) -> None:
        for b in seq.landing:
            self._drop_ref(b, f"{seq.request_id} (landing)")
        seq.landing = []

    def free_seq(self, seq: Sequence) -> None:
        self.free_landing(seq)
        # Tail blocks go into the LRU first (older), so eviction takes a prompt's end
        # before its shared beginning.
        for b in reversed(seq.block_table):
            self._drop_ref(b, seq.request_id)
        seq.block_table = []
        seq.num_registered_blocks = 0
