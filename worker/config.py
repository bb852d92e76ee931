"""One config dataclass per worker process, from CLI flags (and `SPLITFIRE_<FLAG>` env vars): every flag
is declared once, on its field (`common.settings`)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any

from common.settings import add_flags, config_from, setting
from engine.engine_config import EngineConfig, parse_lora_modules  # noqa: F401  (parse_lora_modules: re-exported)
from kvtransfer.config import TransferConfig

ENV_PREFIX = "SPLITFIRE_"
ROLES = ("prefill", "decode", "both")
DEFAULT_GRPC_PORT = {"prefill": 50061, "decode": 50051, "both": 50051}


SERVING, MOONCAKE, DECODE, HOSTING = "serving", "KV transfer (Mooncake)", "decode", "several models in one worker"
DECODE_ROLES = ("decode", "both")


def parse_cpus(spec: str | list[int]) -> list[int]:
    """'0', '0,1', '2-5' → core ids."""
    if isinstance(spec, list):
        return spec
    out: list[int] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if "-" in part:
            lo, hi = part.split("-", 1)
            out.extend(range(int(lo), int(hi) + 1))
        else:
            out.append(int(part))
    return out


@dataclass
class WorkerConfig:
    """A worker process's settings; each field with a flag declares it (`common.settings`), the engine's
    and the transfer engine's are their own dataclasses' (`EngineConfig`, `TransferConfig`)."""

    role: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    host: str = setting("0.0.0.0", "bind address of the gRPC and metrics servers", group=SERVING)
    grpc_port: int = setting(50051, "the gRPC port (default 50061 for prefill workers, 50051 otherwise)",
                             group=SERVING)
    metrics_port: int = setting(0, "Prometheus /metrics (default grpc port + 1000)", group=SERVING)
    advertise: str = setting("", "host:port the router dials (default <mooncake-host>:<grpc-port>)", group=SERVING)
    redis_url: str = setting("", "self-register here for router discovery", env="REDIS_URL", group=SERVING)
    cpus: list[int] = setting(help="pin to these cores, e.g. 0 or 0-3 (also sets torch threads)", factory=list,
                              kind="value", parse=parse_cpus, group=SERVING)
    drain_timeout_s: float = setting(30.0, "SIGTERM: seconds to finish in-flight requests", flag="--drain-timeout",
                                     group=SERVING)
    lora_roots: list[str] = setting(
        help="adapters may be loaded at run time (POST /v1/load_lora_adapter) from under this directory only "
        "(repeatable; none: run-time loading is refused)", factory=list, flag="--lora-root", append=True,
        metavar="DIR", group=SERVING)
    kv_store: str = setting("", "host:port of mooncake_master: share full KV blocks with every worker (Mooncake "
                                "Store)", group=MOONCAKE)
    kv_store_gb: float = setting(0.0, "memory this worker lends to the shared KV store (0: use it, hold none of it)",
                                 group=MOONCAKE)
    # decode role: conditional disaggregation and remote-prefill safety
    local_prefill_max_tokens: int = setting(
        128, "prefill here when the uncached prompt part is at most this many tokens ...", roles=DECODE_ROLES,
        group=DECODE)
    local_prefill_max_fraction: float = setting(
        1.0, "... and at most this fraction of the prompt (0 disables local prefill)", roles=DECODE_ROLES,
        group=DECODE)
    prefill_timeout_s: float = setting(120.0, "seconds a remote prefill may take", flag="--prefill-timeout",
                                       roles=DECODE_ROLES, group=DECODE)
    kv_quarantine_s: float = setting(5.0, "seconds to hold blocks after a failed or aborted transfer (late writes)",
                                     flag="--kv-quarantine", roles=DECODE_ROLES, group=DECODE)
    kv_landing: bool = setting(
        True, "write a prefill worker split over more tensor-parallel ranks row by row into the pages, instead of "
        "letting it send whole pages into spare blocks moved into place here (KVCache.land)", flag="--no-kv-landing",
        const=False, roles=DECODE_ROLES, group=DECODE)
    reserve_timeout_s: float = 30.0  # wait this long for free KV blocks before refusing a request
    stream_interval: int = setting(
        1, "send a stream event every N tokens: fewer gRPC messages (router CPU) for coarser streaming; the first "
        "token and the end are always sent at once", roles=DECODE_ROLES, group=DECODE)
    stream_relay: str = setting(
        "direct", "streams multiplexed to a router: direct frames a step's plain tokens as the engine hands them "
        "out (decode_worker/service.py: no task switch per token per stream); queued sends every output through "
        "the stream's handler (the reference path)", choices=("direct", "queued"), roles=DECODE_ROLES, group=DECODE)
    # Colocated role: more base models this worker serves, loaded when a request names one
    # (worker/model_host.py), within these limits (0: none).
    on_demand_models: list[str] = setting(
        help="another base model this worker serves, loaded when a request names it (repeatable; --model stays "
        "resident)", factory=list, flag="--on-demand-model", append=True, metavar="MODEL",
        env="SPLITFIRE_ON_DEMAND_MODELS", roles=("both",), group=HOSTING)
    max_loaded_models: int = setting(
        0, "models resident at once, --model included (0: no limit); the least recently used idle one is evicted "
        "to load another", roles=("both",), group=HOSTING)
    model_memory_gb: float = setting(0.0, "GiB of weights + KV cache the resident models may take together (0: no "
                                          "limit)", roles=("both",), group=HOSTING)

    def lora_path(self, path: str) -> str:
        """`path` resolved, if it lies under a --lora-root; ValueError naming the rule otherwise."""
        if not self.lora_roots:
            raise ValueError("loading adapters at run time is off on this worker: start it with --lora-root DIR")
        real = os.path.realpath(path)
        for root in self.lora_roots:
            r = os.path.realpath(root)
            if os.path.commonpath([real, r]) == r:
                return real
        raise ValueError(f"lora_path {path!r} is outside the adapter roots (--lora-root: {', '.join(self.lora_roots)})")

    def validate(self) -> WorkerConfig:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not 0 < self.grpc_port < 65536:
            raise ValueError(f"--grpc-port must be in 1..65535, got {self.grpc_port}")
        if self.metrics_port == 0:
            self.metrics_port = self.grpc_port + 1000
        if not 0 < self.metrics_port < 65536 or self.metrics_port == self.grpc_port:
            raise ValueError(f"--metrics-port must be in 1..65535 and differ from --grpc-port, got {self.metrics_port}")
        if self.local_prefill_max_tokens < 0 or not 0 <= self.local_prefill_max_fraction <= 1:
            raise ValueError("--local-prefill-max-tokens must be >= 0 and --local-prefill-max-fraction in [0, 1]")
        for root in self.lora_roots:
            if not os.path.isdir(root):
                raise ValueError(f"--lora-root {root} is not a directory")
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be >= 1, got {self.stream_interval}")
        if self.stream_relay not in ("direct", "queued"):
            raise ValueError(f"--stream-relay must be direct or queued, got {self.stream_relay!r}")
        for name in ("prefill_timeout_s", "kv_quarantine_s", "reserve_timeout_s", "drain_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.cpus and any(c < 0 or c >= (os.cpu_count() or 1) for c in self.cpus):
            raise ValueError(f"--cpus {self.cpus} names a core this machine does not have ({os.cpu_count()} cores)")
        if self.kv_store_gb < 0:
            raise ValueError(f"--kv-store-gb must be >= 0, got {self.kv_store_gb}")
        if self.kv_store:
            from kvtransfer.store import StoreConfig

            StoreConfig(self.kv_store).validate()
        if not self.advertise:
            self.advertise = f"{self.transfer.hostname}:{self.grpc_port}"
        self.engine.validate()
        if self.role != "both":
            self.transfer.validate()
        self._validate_hosting()
        return self

    def _validate_hosting(self) -> None:
        if self.max_loaded_models < 0 or self.model_memory_gb < 0:
            raise ValueError("--max-loaded-models and --model-memory-gb must be >= 0")
        if not self.on_demand_models:
            if self.max_loaded_models or self.model_memory_gb:
                raise ValueError("--max-loaded-models / --model-memory-gb limit the models loaded on demand: "
                                 "add --on-demand-model")
            return
        if self.role != "both":
            raise ValueError("--on-demand-model is served by colocated workers (splitfire serve) for now: a prefill "
                             "or decode worker's KV transfer addresses one model's cache")
        if self.engine.tensor_parallel_size * self.engine.pipeline_parallel_size > 1:
            raise ValueError("--on-demand-model with --tensor-parallel-size / --pipeline-parallel-size above 1 is "
                             "not supported yet")
        if self.engine.device == "cuda":
            raise ValueError("--on-demand-model is CPU-only for now: on CUDA each engine sizes its KV cache from "
                             "the GPU's free memory, so a second model would find none left")
        if self.max_loaded_models == 1:
            raise ValueError("--max-loaded-models 1 leaves no room beside the first model, which stays resident")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    add_flags(p, EngineConfig, ENV_PREFIX)


def engine_config_from(args: argparse.Namespace) -> EngineConfig:
    return config_from(EngineConfig, args)


def add_worker_args(p: argparse.ArgumentParser, role: str) -> None:
    groups: dict[str, Any] = {}
    add_flags(p, EngineConfig, ENV_PREFIX, groups=groups)
    if role == "decode":  # decode workers speculate by default (prompt lookup, lossless)
        p.set_defaults(speculative=os.environ.get(ENV_PREFIX + "SPECULATIVE", "ngram"))
    add_flags(p, WorkerConfig, ENV_PREFIX, role, groups)
    if ENV_PREFIX + "GRPC_PORT" not in os.environ:
        p.set_defaults(grpc_port=DEFAULT_GRPC_PORT[role])
    add_flags(p, TransferConfig, ENV_PREFIX, groups=groups)


def worker_config_from(args: argparse.Namespace, role: str) -> WorkerConfig:
    return config_from(WorkerConfig, args, role, role=role, engine=engine_config_from(args),
                       transfer=config_from(TransferConfig, args)).validate()
