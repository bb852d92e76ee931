"""Mooncake Store: the cluster-wide KV tier's data plane (publish, find, fetch whole KV blocks).

One `MooncakeDistributedStore` client per worker process, with its own Transfer Engine. A KV
block is one object whose bytes are the block's page in every layer (L byte ranges of the one
registered KV buffer): published with `batch_put_from_multi_buffers` and fetched with
`batch_get_into_multi_buffers`, straight between registered buffers, no staging copies.

What `../shared/notes/mooncake_store.md` measured shapes this file:
- keys are content-addressed and written once (a put of a present key is a no-op that keeps
  the first bytes; `upsert` and forced removes tear concurrent reads, so neither is used);
- `MC_RPC_TIMEOUT_MS` bounds every call to a hung master (30 s otherwise), and `setup()` is
  tried once after a TCP probe of the master (it retries 20 x 4.4 s otherwise);
- `health_check()` says healthy with the master dead, so a failed call (RPC_FAIL/TIMEOUT)
  opens a breaker: the store is skipped, then probed by TCP, and used again when it answers;
- a batch is never all-or-nothing: every key's result is checked, and a fetch counts only
  the leading run of blocks that arrived whole.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from kvtransfer.errors import TransferError

log = logging.getLogger("splitfire.kvtransfer")

RPC_FAIL, RPC_TIMEOUT, TRANSFER_FAIL = -900, -901, -800
_BREAKER_S = 3.0  # how long the store is skipped after a failed call before it is probed again


@dataclass(frozen=True)
class StoreConfig:
    master: str  # host:port of mooncake_master's RPC port
    hostname: str = "127.0.0.1"  # address other workers reach this one's Transfer Engine at
    lend_bytes: int = 0  # memory this worker lends to the cluster-wide pool (--kv-store-gb)
    protocol: str = "tcp"
    device: str = ""  # RDMA NICs
    rpc_timeout_ms: int = 1000

    def validate(self) -> StoreConfig:
        host, _, port = self.master.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--kv-store must be host:port of mooncake_master, got {self.master!r}")
        if self.lend_bytes < 0:
            raise ValueError("--kv-store-gb must be >= 0")
        return self


class KVStore:
    """Thread-safe enough for its use: calls come from one executor thread at a time per kind."""

    def __init__(self, cfg: StoreConfig):
        self.cfg = cfg.validate()
        self._store: Any = None
        self._buffers: list[tuple[int, int]] = []
        self._down_until = 0.0
        self._lock = threading.Lock()
        self.state = "disconnected"  # disconnected | up | down
        os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(cfg.rpc_timeout_ms))
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")

    # -- connection -----------------------------------------------------------------

    def _master_answers(self) -> bool:
        host, _, port = self.cfg.master.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=0.5):
                return True
        except OSError:
            return False

    def _connect(self) -> bool:
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        rc = store.setup(self.cfg.hostname, "P2PHANDSHAKE", self.cfg.lend_bytes, 0, self.cfg.protocol,
                         self.cfg.device, self.cfg.master)
        if rc != 0:
            log.warning("event=kv_store_setup_failed master=%s rc=%d", self.cfg.master, rc)
            return False
        for base, nbytes in self._buffers:
            if store.register_buffer(base, nbytes) != 0:
                raise TransferError(f"cannot register {nbytes} bytes at {base:#x} with Mooncake Store")
        self._store = store
        return True

    def ready(self) -> bool:
        """True when calls should go to the store now (connects or re-probes as needed, cheaply)."""
        if self.state == "up":
            return True
        now = time.monotonic()
        if now < self._down_until:
            return False
        with self._lock:
            if self.state == "up":
                return True
            self._down_until = now + _BREAKER_S
            if not self._master_answers():
                self._mark("down", "master does not answer")
                return False
            if self._store is None and not self._connect():
                self._mark("down", "setup failed")
                return False
            self._mark("up", "")
            return True

    def _mark(self, state: str, why: str) -> None:
        if state != self.state:
            level = logging.INFO if state == "up" else logging.WARNING
            log.log(level, "event=kv_store_%s master=%s %s", state, self.cfg.master, why)
        self.state = state

    def _failed(self, codes: list[int]) -> None:
        if any(c in (RPC_FAIL, RPC_TIMEOUT) for c in codes):
            self._down_until = time.monotonic() + _BREAKER_S
            self._mark("down", f"rpc error {min(codes)}")

    def register(self, base: int, nbytes: int) -> None:
        """The KV buffer, once; re-registered by itself after a reconnect."""
        self._buffers.append((base, nbytes))
        if self._store is not None and self._store.register_buffer(base, nbytes) != 0:
            raise TransferError(f"cannot register {nbytes} bytes at {base:#x} with Mooncake Store")

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    # -- data -----------------------------------------------------------------------

    def present(self, keys: list[str]) -> int:
        """How many of `keys`, from the first, the store holds (0 when it is unavailable)."""
        if not keys or not self.ready():
            return 0
        codes = self._store.batch_is_exist(keys)
        for i, c in enumerate(codes):
            if c != 1:
                self._failed([c])
                return i
        return len(keys)

    def get(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> int:
        """Read each key's object into its ranges; the number of leading keys read whole."""
        if not keys or not self.ready():
            return 0
        codes = self._store.batch_get_into_multi_buffers(keys, ptrs, sizes)
        for i, (c, s) in enumerate(zip(codes, sizes, strict=True)):
            if c != sum(s):
                self._failed(list(codes[i:]))
                return i
        return len(keys)

    def put(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> int:
        """Publish objects (keys already present are left as they are); the number that succeeded.
        A refused key (the pool is full: -200) is simply not cached."""
        if not keys or not self.ready():
            return 0
        codes = self._store.batch_put_from_multi_buffers(keys, ptrs, sizes)
        self._failed([c for c in codes if c < 0])
        return sum(1 for c in codes if c == 0)


def master_command(rpc_port: int, metrics_port: int, host: str = "127.0.0.1") -> list[str]:
    """argv of a `mooncake_master` for the KV tier (the ELF inside the Mooncake wheel).

    A 2 s read lease outlives any block read here yet lets idle blocks be evicted soon; a client
    silent for 5 s is dropped with its segment (clients ping every second). INFO logging is off:
    the master prints a metrics summary every few seconds otherwise."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise TransferError("the Mooncake wheel is not installed (mooncake-transfer-engine[-non-cuda])")
    binary = Path(next(iter(spec.submodule_search_locations))) / "mooncake_master"
    if not binary.is_file():
        raise TransferError(f"{binary} not found: this Mooncake wheel has no mooncake_master")
    return [str(binary), f"-rpc_port={rpc_port}", f"-rpc_address={host}", f"-metrics_port={metrics_port}",
            f"-metrics_host={host}", "-default_kv_lease_ttl=2000", "-client_ttl=5", "-minloglevel=1"]
