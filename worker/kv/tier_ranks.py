"""The cluster-wide KV tier over a worker's model-parallel ranks: each rank publishes and fetches its own pages.

A tensor-parallel rank holds its own KV heads of every page, a pipeline stage its own layers, each in a
cache of its own process (or device). So a block of a model-parallel worker is one store object per
distinct part — `key prefix + part + block hash`, the part naming the layers and KV heads it holds
(`part_names`) — and every rank reads and writes its own object with its own Mooncake Store client
(a `StoreAgent` on the ranks other than 0, driven by rank 0's `KVTier` over a local connection).
Ranks that hold the same part (a KV head replicated over several ranks, a latent cache whole on every
rank) share one object: the lowest of them publishes it, each fetches it.

A block counts as fetched only when every rank read its part whole: the tier uses the leading run of
blocks all ranks got (`min` of their answers); the rest is computed. A block one rank published but
another did not is never used. The key prefix commits to the split (`tp`, `pp`), so workers split
differently miss each other's blocks instead of reading pages of another shape.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import torch

from engine.model.kv_cache import KVCache
from kvtransfer.store import KVStore, StoreConfig

log = logging.getLogger("splitfire.worker")


@dataclass(frozen=True)
class AgentAddress:
    """Where rank 0 reaches a rank's `StoreAgent` (a local socket and its key)."""

    address: tuple[str, int]
    authkey: bytes


def part_names(layers: list[range], heads: list[range], total_layers: int, total_heads: int) -> list[str]:
    """Each rank's part of a block as it appears in a store key (rank = stage * tp + tp rank): `layers`
    per stage, `heads` per tensor-parallel rank; "" for the whole block (one rank: keys unchanged)."""
    out = []
    for layer_range in layers:
        for head_range in heads:
            part = []
            if (layer_range.start, layer_range.stop) != (0, total_layers):
                part.append(f"L{layer_range.start}-{layer_range.stop}")
            if (head_range.start, head_range.stop) != (0, total_heads):
                part.append(f"H{head_range.start}-{head_range.stop}")
            out.append(".".join(part) + "/" if part else "")
    return out


def publishers(parts: list[str]) -> list[bool]:
    """Which ranks publish: the first rank holding each distinct part (replicas fetch, never re-publish)."""
    return [parts.index(p) == r for r, p in enumerate(parts)]


STAGING_BYTES = 32 << 20  # per direction (fetch, publish) and rank


class StorePages:
    """One rank's KV pages in the store: a block's object is its page in every layer of this rank's cache.

    The cache is layer-major, so a block's pages are `num_layers` ranges apart, and written in place each
    is a transfer of its own (on TCP, a request each: 3,810 of 24 KiB for a 2,048-token SmolLM2 prompt).
    Staged (the default), a batch of blocks is gathered into a registered buffer laid out block-major
    (`[blocks, layers, page]`, the object's bytes in order) and moved as one range per block, and fetched
    blocks are read into it and scattered into the layers' pages with one tensor copy. The bytes of an
    object are the same either way, so staged and in-place workers read each other's blocks
    (`tests/test_kv_store_staging.py`); in place (`staging_bytes=0`, or SPLITFIRE_KV_STORE_STAGING=0) is the
    plain reference."""

    def __init__(self, store: KVStore, kv: KVCache, staging_bytes: int | None = None):
        layout = kv.layout
        self.store = store
        self._base = kv.base_address
        self._page = layout.page_bytes
        self._layers = layout.num_layers
        self._stride = layout.num_blocks * layout.page_bytes
        if staging_bytes is None:
            staging_bytes = STAGING_BYTES if os.environ.get("SPLITFIRE_KV_STORE_STAGING", "1") != "0" else 0
        block_bytes = self._layers * self._page
        self.capacity = staging_bytes // block_bytes  # blocks per staged batch (0: in place)
        # [layers, blocks, page bytes]: pages move as bytes, whatever the cache's element type (torch has no
        # index_copy_ for float8)
        self._pages = kv.buffer.view(torch.uint8).view(self._layers, layout.num_blocks, -1)
        self._buffers: dict[str, torch.Tensor] = {}
        if self.capacity:
            for op in ("get", "put"):  # (the fetch and publish threads each have their own)
                buf = torch.empty(self.capacity, self._layers, self._pages.shape[2], dtype=torch.uint8,
                                  device=kv.buffer.device)
                store.register(buf.data_ptr(), buf.numel() * buf.element_size())
                self._buffers[op] = buf
        else:
            store.register(kv.base_address, kv.nbytes)
        self._cuda = kv.buffer.device.type == "cuda"

    def ranges(self, blocks: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        """Each block's page in every layer: where its object's bytes come from or go to (in place)."""
        ptrs = [[self._base + b * self._page + layer * self._stride for layer in range(self._layers)] for b in blocks]
        return ptrs, [[self._page] * self._layers for _ in blocks]

    def _staged(self, buf: torch.Tensor, n: int) -> tuple[list[list[int]], list[list[int]]]:
        size = buf[0].numel() * buf.element_size()
        return [[buf.data_ptr() + i * size] for i in range(n)], [[size]] * n

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.current_stream(self._pages.device).synchronize()

    def _batches(self, keys: list[str], blocks: list[int]) -> Iterator[tuple[list[str], list[int]]]:
        """The keys and their blocks in batches of the staging buffers' capacity."""
        for i in range(0, len(keys), self.capacity):
            yield keys[i : i + self.capacity], blocks[i : i + self.capacity]

    def get(self, keys: list[str], blocks: list[int]) -> int:
        """Read `keys` into `blocks`: how many leading blocks arrived whole."""
        if not keys or not self.capacity:
            return self.store.get(keys, *self.ranges(blocks)) if keys else 0
        buf, done = self._buffers["get"], 0
        for ks, bs in self._batches(keys, blocks):
            got = self.store.get(ks, *self._staged(buf, len(ks)))
            if got:  # the arrived blocks scattered into their pages, block-major to layer-major
                self._pages.index_copy_(1, torch.tensor(bs[:got], dtype=torch.long, device=buf.device),
                                        buf[:got].transpose(0, 1))
                self._sync()
            done += got
            if got < len(ks):
                break
        return done

    def put(self, keys: list[str], blocks: list[int]) -> int:
        if not keys or not self.capacity:
            return self.store.put(keys, *self.ranges(blocks)) if keys else 0
        buf, done = self._buffers["put"], 0
        for ks, bs in self._batches(keys, blocks):  # each batch gathered block-major, then written
            buf[: len(bs)].copy_(self._pages.index_select(1, torch.tensor(bs, dtype=torch.long, device=buf.device))
                                 .transpose(0, 1))
            self._sync()
            done += self.store.put(ks, *self._staged(buf, len(ks)))
        return done


class StoreAgent:
    """A rank's store client (rank > 0), serving rank 0's `get` / `put` of its own pages: one thread per
    connection (rank 0 opens one for fetches and one for publishes, so neither waits for the other)."""

    def __init__(self, cfg: StoreConfig, kv: KVCache):
        self.store = KVStore(cfg)
        self.pages = StorePages(self.store, kv)
        self.store.ready()  # connect now if the master answers; calls retry later otherwise
        self.authkey = secrets.token_bytes(16)
        self.listener = Listener(("127.0.0.1", 0), authkey=self.authkey)
        self.closed = False
        self._conns: list[Connection] = []
        threading.Thread(target=self._accept, daemon=True, name="kv-store-agent").start()

    @property
    def address(self) -> AgentAddress:
        host, port = self.listener.address
        return AgentAddress((host, port), self.authkey)

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn = self.listener.accept()
            except OSError:
                return  # (closed)
            except Exception:  # a peer without the key: refused, keep listening
                log.exception("event=kv_store_agent_refused")
                continue
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True, name="kv-store-agent-conn").start()

    def _serve(self, conn: Connection) -> None:
        while True:
            try:
                op, keys, blocks = conn.recv()
            except (EOFError, OSError):
                return  # rank 0 closed it
            try:
                n = self.pages.get(keys, blocks) if op == "get" else self.pages.put(keys, blocks)
            except Exception:  # a cache: rank 0 counts this rank's blocks as missing
                log.exception("event=kv_store_agent_failed op=%s blocks=%d", op, len(keys))
                n = 0
            conn.send(n)

    def close(self) -> None:
        self.closed = True
        self.listener.close()
        for conn in self._conns:
            conn.close()
        self.store.close()


class RemotePages:
    """Rank 0's handle on one other rank's `StoreAgent`: a request sent, its answer read later, so every
    rank's transfer runs at once."""

    def __init__(self, agent: AgentAddress):
        self._conns = {kind: Client(agent.address, authkey=agent.authkey) for kind in ("get", "put")}

    def send(self, op: str, keys: list[str], blocks: list[int]) -> None:
        self._conns[op].send((op, keys, blocks))

    def answer(self, op: str) -> int:
        n: Any = self._conns[op].recv()
        return int(n)

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
