"""The router's one config dataclass, from CLI flags and env vars (`SPLITFIRE_ROUTER_<FLAG>`), validated at
start; each flag is declared once, on its field (`common.settings`)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from common.settings import add_flags, config_from, setting
from router.core.breaker import BreakerConfig

POLICIES = ("token", "round_robin", "random")


ENV_PREFIX = "SPLITFIRE_ROUTER_"
MODELS, FLEET, PLACEMENT, LIMITS, STREAMS = "models", "fleet", "placement", "limits and tenancy", "streams"
BATCH = "files and batches"
BATCH_PRIORITY = 1_000_000  # batch lines' default priority: below any interactive request's


@dataclass
class RouterConfig:
    """The router's settings; a field with a flag declares it once (`common.settings`)."""

    host: str = setting("0.0.0.0", "bind address")
    port: int = setting(8000, "HTTP port")
    model: str | None = setting(None, "model whose tokenizer and chat template to use", env="SPLITFIRE_MODEL",
                                group=MODELS)
    served_model_name: str = setting("", "model name clients send (default: the model directory's)", group=MODELS)
    # More models behind the same router, NAME=MODEL each: requests naming one go to the workers that report
    # its directory's name (router/core/model_pools.py).
    extra_models: list[str] = setting(
        help="another model behind this router (repeatable): requests naming NAME go to the workers that serve "
        "MODEL (they report its directory's name)", factory=list, flag="--extra-model", append=True,
        metavar="NAME=MODEL", env=False, group=MODELS)
    prefill: list[str] = setting(help="prefill workers", factory=list, nargs="*", metavar="HOST:PORT", group=FLEET)
    decode: list[str] = setting(help="decode workers", factory=list, nargs="*", metavar="HOST:PORT", group=FLEET)
    colocated: list[str] = setting(help="colocated (serve) workers", factory=list, nargs="*", metavar="HOST:PORT",
                                   group=FLEET)
    openai_upstream: list[str] = setting(help="OpenAI-compatible servers to balance across (vLLM, SGLang, "
                                              "llama.cpp)", factory=list, nargs="*", metavar="URL", group=FLEET)
    openai_upstream_api_key: str = setting(
        "", "Bearer token sent to every OpenAI-compatible upstream (prefer the environment: flags show in ps)",
        metavar="KEY", group=FLEET)
    discover_dns: list[str] = setting(help="resolve a headless Service's A records for workers of a role",
                                      factory=list, nargs="*", metavar="ROLE=HOST:PORT", group=FLEET)
    redis_url: str = setting("", "affinity pins, quotas and the worker registry (\"\" = in-process state)",
                             env="REDIS_URL", group=FLEET)
    redis_wait_s: float = setting(
        60.0, "seconds to keep retrying an unreachable Redis at start before exiting (a Redis pod starting beside "
        "the router); 0 = fail at once", flag="--redis-wait", group=FLEET)
    policy: str = setting("token", "how an endpoint is chosen among the healthy ones", choices=POLICIES,
                          group=PLACEMENT)
    affinity_ttl_s: float = setting(1800.0, "seconds a session pin lives", flag="--affinity-ttl", group=PLACEMENT)
    affinity_overload_factor: float = 2.0  # break a pin when its endpoint carries this many times the mean load ...
    affinity_overload_min_tokens: int = 4096  # ... and more than this many tokens in flight
    prefix_aware: bool = setting(True, "ignore prefix-cache locality when placing", flag="--no-prefix-aware",
                                 const=False, group=PLACEMENT)
    prefix_index_blocks: int = setting(65_536, "block hashes remembered per endpoint for prefix-aware placement "
                                               "(~1M tokens, ~6 MB)", group=PLACEMENT)
    shared_kv_store: bool = setting(
        False, "the workers share a KV store (their --kv-store): a prefix cached on any worker costs a fetch, not a "
        "recompute, on the others", group=PLACEMENT)
    reuse_port: bool = setting(False, "bind with SO_REUSEPORT so several router replicas share the port (the "
                                      "kernel spreads connections over them)")
    kv_events: bool = setting(
        True, "with --redis-url, do not build the exact prefix index from the workers' KV events (keep the "
        "per-replica approximation)", flag="--no-kv-events", const=False, group=PLACEMENT)
    block_size: int = 16
    max_concurrency: int = setting(256, "requests being served at once", group=LIMITS)
    max_queue: int = setting(512, "requests waiting for a slot; beyond it, the least important priority band "
                                  "waiting is shed (429), or the request is refused (503)", group=LIMITS)
    queue_timeout_s: float = 30.0
    max_body_bytes: int = setting(4 * 2**20, "largest request body accepted (413 beyond)", group=LIMITS)
    max_retries: int = setting(2, "attempts after the first on another endpoint", group=PLACEMENT)
    retry_backoff_s: float = 0.05
    health_interval_s: float = setting(2.0, "seconds between health checks", flag="--health-interval",
                                       group=PLACEMENT)
    health_timeout_s: float = 1.0
    unhealthy_after: int = 2  # consecutive failed checks
    worker_stream: str = setting(
        "mux", "read workers' token streams all on one connection to each worker's HTTP port (mux: a step's tokens "
        "in one read), one HTTP stream each (length-prefixed frames), or over gRPC; a worker that serves no mux or "
        "HTTP stream is read over the next", choices=("mux", "http", "grpc"), group=STREAMS)
    stream_relay: str = setting(
        "direct", "direct: a mux stream's plain tokens are rendered and written to the client from the worker "
        "connection's read (router/app/direct_relay.py: no task switch per token); queued: every token through the "
        "stream's reader (the reference path)", choices=("direct", "queued"), group=STREAMS)
    breaker_error_rate: float = setting(0.5, "eject an endpoint when this share of its last 20 requests failed (or 3 "
                                             "in a row)", group=PLACEMENT)
    breaker_open_s: float = setting(2.0, "seconds an ejected endpoint waits before a probe request (doubling per "
                                         "failed probe)", group=PLACEMENT)
    stats_interval_s: float = 1.0
    api_keys_file: str = setting(
        "", "API keys: 'key tenant' lines, or JSON {\"keys\": {KEY: {tenant, weight, max_concurrent, "
        "requests_per_minute, tokens_per_minute, models, admin}}}; enables auth; re-read on SIGHUP",
        flag="--api-keys", group=LIMITS)
    request_timeout_s: float = 600.0
    enable_cache_reset: bool = setting(
        False, "serve POST /reset_prefix_cache (every worker forgets its cached prefixes; for benchmarks: any "
        "client could otherwise wipe every cache)")
    early_headers: bool = setting(
        False, "streams answer 200 at once (before the first token) instead of with it; a request that fails "
        "before its first token then ends with an error event, not an HTTP status", group=STREAMS)
    keepalive_timeout_s: float = setting(
        15.0, "seconds an idle client connection is kept, and the most a new one may take to send its request head "
        "(slow-header clients are dropped)", flag="--keepalive-timeout")
    files_dir: str = setting(
        "", "where /v1/files keeps uploaded files, batch outputs and batch state (shared by router replicas: a "
        "ReadWriteMany volume); \"\" = $SPLITFIRE_HOME/files", metavar="DIR", group=BATCH)
    max_file_bytes: int = setting(200 * 2**20, "largest file /v1/files accepts (413 beyond)", group=BATCH)
    max_files_per_tenant: int = setting(1000, "files a tenant may keep (uploads and batch outputs); beyond, 429",
                                        group=BATCH)
    max_batches_per_tenant: int = setting(20, "batches a tenant may have unfinished at once; beyond, 429",
                                          group=BATCH)
    batch_concurrency: int = setting(16, "batch lines each router replica sends at once", group=BATCH)
    batch_busy_concurrency: int = setting(
        1, "batch lines each router replica sends at once while more important requests run or wait there (and for "
        "a second after), once --batch-busy-pause has passed: the batch yields the fleet to interactive traffic; 0 "
        "pauses it for as long as they are there (a replica never quiet for a second never runs its batch); "
        "= --batch-concurrency to never yield",
        group=BATCH)
    batch_busy_pause_s: float = setting(
        30.0, "seconds a stretch of more important requests at a router has the fleet to itself: no new batch line "
        "starts until then, --batch-busy-concurrency after (a burst is not slowed by the batch, steady traffic does "
        "not starve it); 0: never paused", flag="--batch-busy-pause", group=BATCH)
    batch_lease_s: float = setting(
        30.0, "seconds a router replica's claim on a batch it runs lasts unrenewed (renewed every third of it): how "
        "long a batch waits before another replica takes over from one that died (needs --redis-url: without Redis "
        "the lock goes with the process)", flag="--batch-lease", group=BATCH)
    batch_priority: int = setting(BATCH_PRIORITY, "priority of batch lines (lower is more important): by default "
                                  "below interactive requests, so they wait and are shed first", group=BATCH)

    def breaker(self) -> BreakerConfig:
        return BreakerConfig(error_rate=self.breaker_error_rate, open_s=self.breaker_open_s,
                             unhealthy_after=self.unhealthy_after)

    def extra_model_specs(self) -> list[tuple[str, str]]:
        out = []
        for spec in self.extra_models:
            name, sep, model = spec.partition("=")
            if not sep or not name or not model:
                raise ValueError(f"--extra-model expects NAME=MODEL (a served name and a model directory or built-in "
                                 f"name), got {spec!r}")
            out.append((name, model))
        names = [n for n, _ in out]
        if len(set(names)) != len(names) or (self.served_model_name and self.served_model_name in names):
            raise ValueError(f"--extra-model names must differ from each other and from --served-model-name: {names}")
        return out

    def validate(self) -> RouterConfig:
        self.extra_model_specs()
        if self.extra_models and self.model is None:
            raise ValueError("--extra-model needs --model (the first model) as well")
        if self.redis_wait_s < 0:
            raise ValueError(f"--redis-wait must be >= 0 seconds, got {self.redis_wait_s}")
        if self.policy not in POLICIES:
            raise ValueError(f"--policy must be one of {POLICIES}, got {self.policy!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        if self.prefill and not self.decode:
            raise ValueError("--prefill given without any --decode endpoint")
        for spec in self.discover_dns:
            role, _, target = spec.partition("=")
            if role not in ("prefill", "decode", "colocated") or ":" not in target:
                raise ValueError(f"--discover-dns expects role=host:port (role prefill|decode|colocated), got {spec!r}")
        for url in self.openai_upstream:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--openai-upstream must be an http(s) URL, got {url!r}")
        for addr in self.prefill + self.decode + self.colocated:
            host, _, port = addr.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"endpoint {addr!r} must be host:port")
        if not (self.prefill or self.decode or self.colocated or self.openai_upstream or self.discover_dns
                or self.redis_url):
            raise ValueError("no endpoints: give --decode/--prefill/--colocated, --openai-upstream, "
                             "--discover-dns, or --redis-url (workers self-register)")
        if self.api_keys_file and not os.path.isfile(self.api_keys_file):
            raise ValueError(f"--api-keys file {self.api_keys_file!r} does not exist")
        if self.prefix_index_blocks < 1:
            raise ValueError("--prefix-index-blocks must be >= 1")
        if self.keepalive_timeout_s <= 0:
            raise ValueError("--keepalive-timeout must be > 0")
        if self.worker_stream not in ("mux", "http", "grpc"):
            raise ValueError(f"--worker-stream must be mux, http or grpc, got {self.worker_stream!r}")
        if self.stream_relay not in ("direct", "queued"):
            raise ValueError(f"--stream-relay must be direct or queued, got {self.stream_relay!r}")
        if not 0 < self.breaker_error_rate <= 1 or self.breaker_open_s <= 0:
            raise ValueError("--breaker-error-rate must be in (0, 1] and --breaker-open-s > 0")
        if self.max_concurrency < 1 or self.max_queue < 0 or self.max_retries < 0:
            raise ValueError("--max-concurrency must be >= 1, --max-queue and --max-retries >= 0")
        if min(self.max_file_bytes, self.max_files_per_tenant, self.max_batches_per_tenant,
               self.batch_concurrency) < 1 or self.batch_busy_concurrency < 0 or not self.batch_busy_pause_s >= 0:
            raise ValueError("--max-file-bytes, --max-files-per-tenant, --max-batches-per-tenant and "
                             "--batch-concurrency must be >= 1, --batch-busy-concurrency and --batch-busy-pause >= 0")
        if self.batch_lease_s != 30.0 and not self.redis_url:
            raise ValueError("--batch-lease is the expiry of a batch's Redis lease: give --redis-url too (without "
                             "Redis a batch's lock is a file lock, which goes with the process that holds it)")
        if not self.batch_lease_s >= 1.0:
            raise ValueError(f"--batch-lease must be >= 1 second (it is renewed every third of it), got "
                             f"{self.batch_lease_s}")
        if self.batch_busy_concurrency > self.batch_concurrency:
            raise ValueError(f"--batch-busy-concurrency ({self.batch_busy_concurrency}) cannot exceed "
                             f"--batch-concurrency ({self.batch_concurrency})")
        return self

    def files_root(self) -> str:
        if self.files_dir:
            return self.files_dir
        home = os.environ.get("SPLITFIRE_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "splitfire")
        return os.path.join(home, "files")


def add_router_args(p: argparse.ArgumentParser) -> None:
    add_flags(p, RouterConfig, ENV_PREFIX)


def router_config_from(args: argparse.Namespace) -> RouterConfig:
    return config_from(RouterConfig, args).validate()
