"""A thin, loud wrapper over `mooncake.engine.TransferEngine`.

Mooncake's Python calls return bare integers; every one is checked here and turned
into an exception that names the call, the peer and the code. Only single-entry
async writes are used: `transfer_submit_write` + `transfer_check_status` can be
polled without busy-spinning a core (the sync and batch waits spin), which measured
1.6x faster for large writes on a 2-core host (notes/mooncake.md, P6).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import tempfile
import threading
from contextlib import contextmanager

from kvtransfer.config import TransferConfig
from kvtransfer.descriptors import KVRegion
from kvtransfer.errors import TransferError, TransferSetupError

log = logging.getLogger("splitfire.kvtransfer")

DONE, PENDING, FAILED, TIMED_OUT = 1, 0, -1, -2
# Printed by every engine start even at MC_LOG_LEVEL=ERROR, and harmless (notes/mooncake.md, P1).
_KNOWN_NOISE = ("Logging before InitGoogleLogging", "Local segment descriptor not found")


@contextmanager
def _filtered_stderr():
    """Capture fd 2 around engine start-up and pass on everything but the known noise."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            for line in tmp.read().decode(errors="replace").splitlines():
                if not any(n in line for n in _KNOWN_NOISE):
                    print(line, file=sys.stderr)


class MooncakeTransport:
    def __init__(self, config: TransferConfig):
        self.config = config.validate()
        # Must be set before the engine exists: the constructor reads them.
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        os.environ["MC_TRANSFER_TIMEOUT"] = str(config.timeout_s)
        if config.protocol == "tcp":
            os.environ["MC_FORCE_TCP"] = "1"  # `protocol` alone does not pick the transport (P10)
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            if importlib.util.find_spec("mooncake") is not None:  # installed, but its engine cannot load
                raise TransferSetupError(
                    f"Mooncake is installed but its transfer engine cannot load: {e} (its shared libraries need "
                    "Debian's libibverbs1, librdmacm1, libnuma1 and libcurl4)"
                ) from e
            raise TransferSetupError(
                "Mooncake is not installed: pip install mooncake-transfer-engine-non-cuda (CPU hosts, needs "
                "Debian libibverbs1) or mooncake-transfer-engine (CUDA hosts)"
            ) from e
        with _filtered_stderr():
            self._engine = TransferEngine()
            rc = self._engine.initialize(config.hostname, config.metadata, config.protocol, config.device_name)
        if rc != 0:
            raise TransferSetupError(
                f"Mooncake initialize(host={config.hostname}, metadata={config.metadata}, "
                f"protocol={config.protocol}) failed with {rc}"
            )
        if config.metadata == "P2PHANDSHAKE":
            # In P2P mode the port in local_hostname is ignored; peers use the RPC port picked here.
            self.segment = f"{config.hostname}:{self._engine.get_rpc_port()}"
        else:
            self.segment = config.hostname
        self._lock = threading.Lock()
        self._registered: list[int] = []
        log.info("mooncake ready segment=%s protocol=%s metadata=%s", self.segment, config.protocol, config.metadata)

    def register(self, address: int, nbytes: int, location: str = "cpu:0") -> None:
        rc = self._engine.register_memory(address, nbytes, location)
        if rc != 0:
            raise TransferSetupError(f"Mooncake register_memory({nbytes} bytes at {address:#x}, {location}) failed: {rc}")
        self._registered.append(address)

    def register_kv(self, base_address: int, num_layers: int, num_blocks: int, page_bytes: int,
                    location: str = "cpu:0") -> KVRegion:
        """Register a KV cache buffer (layer-major pages, a page = one block's K and V in one layer) so
        peers can write into it, and describe it page by page."""
        region = KVRegion(base_address, num_layers, num_blocks, page_bytes)
        self.register(base_address, region.nbytes, location)
        return region

    def submit_write(self, target: str, local: int, remote: int, length: int) -> int:
        batch_id = self._engine.transfer_submit_write(target, local, remote, length)
        if batch_id == 0:  # batch ids are unsigned; 0 means the submit itself failed
            raise TransferError(f"Mooncake submit of {length} bytes to {target} failed (peer unreachable?)")
        return batch_id

    def check(self, batch_id: int) -> int:
        """DONE, PENDING, FAILED or TIMED_OUT. Frees the id on DONE and FAILED (never check it again)."""
        return self._engine.transfer_check_status(batch_id)

    def close(self) -> None:
        for addr in self._registered:
            self._engine.unregister_memory(addr)
        self._registered.clear()
