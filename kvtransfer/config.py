"""Transfer-engine settings, validated before Mooncake is touched (some bad values abort the process)."""

from __future__ import annotations

from dataclasses import dataclass, field


def _flag(flag: str, help: str, **kw: object) -> dict:
    """A field's command-line flag, in the form `common.settings` reads (this package imports nothing of ours)."""
    return {"setting": {"flag": flag, "help": help, "group": "KV transfer (Mooncake)", **kw}}


@dataclass
class TransferConfig:
    hostname: str = field(default="127.0.0.1", metadata=_flag(
        "--mooncake-host", "address peers reach this worker at (a routable IP across hosts)"))
    protocol: str = field(default="tcp", metadata=_flag("--mooncake-protocol", "tcp | rdma", choices=("tcp", "rdma")))
    metadata: str = field(default="P2PHANDSHAKE", metadata=_flag(
        "--mooncake-metadata", "P2PHANDSHAKE, etcd://host:port or http://host:port/metadata"))
    device_name: str = field(default="", metadata=_flag("--mooncake-device", "RDMA NICs, e.g. mlx5_0,mlx5_1 (default "
                                                                             "all)"))
    timeout_s: int = field(default=30, metadata=_flag(
        "--mooncake-timeout", "Mooncake's own per-transfer timeout in seconds (MC_TRANSFER_TIMEOUT, >= 5)"))
    max_inflight_entries: int = 1024  # per peer; Mooncake TCP rejects beyond ~2048 and still writes some

    def validate(self) -> TransferConfig:
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"--mooncake-protocol must be tcp or rdma, got {self.protocol!r}")
        m = self.metadata
        if m != "P2PHANDSHAKE" and not m.startswith(("etcd://", "http://", "https://")):
            # Mooncake's PyPI build has no redis plugin, and an unknown scheme aborts the process.
            raise ValueError(
                f"--mooncake-metadata must be P2PHANDSHAKE, etcd://host:port or http://host:port/path, got {m!r}"
            )
        if self.hostname in ("", "0.0.0.0"):
            raise ValueError("--mooncake-host must be an address peers can reach, not empty or 0.0.0.0")
        if self.timeout_s < 5:
            raise ValueError("--mooncake-timeout must be >= 5 s (Mooncake's minimum)")
        if not 1 <= self.max_inflight_entries <= 2048:
            raise ValueError("max_inflight_entries must be in [1, 2048]")
        return self
