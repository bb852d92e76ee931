"""The router's one config dataclass, from CLI flags and env vars, validated at start."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from router.core.breaker import BreakerConfig

POLICIES = ("token", "round_robin", "random")


@dataclass
class RouterConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    model: str | None = None  # for the tokenizer and chat template; default $SPLITFIRE_MODEL
    served_model_name: str = ""  # name clients use; default the model directory's name
    # More models behind the same router, NAME=MODEL each: requests naming one go to the workers that report
    # its directory's name (router/model_pools.py).
    extra_models: list[str] = field(default_factory=list)
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    colocated: list[str] = field(default_factory=list)
    openai_upstream: list[str] = field(default_factory=list)
    openai_upstream_api_key: str = ""  # sent as a Bearer token to every OpenAI-compatible upstream
    discover_dns: list[str] = field(default_factory=list)  # role=host:port (a headless Service)
    redis_url: str = ""  # affinity pins + worker self-registration; "" = in-process state
    redis_wait_s: float = 60.0  # at start, how long to retry an unreachable Redis before exiting
    policy: str = "token"
    affinity_ttl_s: float = 1800.0
    affinity_overload_factor: float = 2.0  # break a pin when its endpoint carries this many times the mean load ...
    affinity_overload_min_tokens: int = 4096  # ... and more than this many tokens in flight
    prefix_aware: bool = True
    prefix_index_blocks: int = 65_536  # block hashes remembered per endpoint (~1M tokens, ~6 MB)
    shared_kv_store: bool = False  # workers share a KV store: a block cached anywhere is cheap everywhere
    reuse_port: bool = False  # several replicas on one port (SO_REUSEPORT; `splitfire up --routers N`)
    kv_events: bool = True  # with --redis-url: an exact prefix index from the workers' KV events (router/kv_events.py)
    block_size: int = 16
    max_concurrency: int = 256  # requests being served
    max_queue: int = 512  # requests waiting for a slot; beyond it, 429
    queue_timeout_s: float = 30.0
    max_body_bytes: int = 4 * 2**20
    max_retries: int = 2
    retry_backoff_s: float = 0.05
    health_interval_s: float = 2.0
    health_timeout_s: float = 1.0
    unhealthy_after: int = 2  # consecutive failed checks
    worker_stream: str = "mux"  # token streams from workers: "mux" (all on one connection to their HTTP port),
    # "http" (one HTTP stream each) or "grpc"; a worker that serves no mux or HTTP stream is read over the next
    stream_relay: str = "direct"  # "direct": plain tokens of a mux stream written from the connection's read
    # callback (router/direct_relay.py); "queued": every token through the stream's reader (the reference)
    breaker_error_rate: float = 0.5  # eject an endpoint when this share of its recent requests failed
    breaker_open_s: float = 2.0  # how long an ejected endpoint waits before a probe request (doubles per failed probe)
    stats_interval_s: float = 1.0
    api_keys_file: str = ""
    request_timeout_s: float = 600.0
    enable_cache_reset: bool = False  # POST /reset_prefix_cache (benchmarks); any client could wipe every cache
    early_headers: bool = False  # streams: send the 200 head at once instead of with the first token
    keepalive_timeout_s: float = 15.0  # idle client connections, and the wait for a request's head

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
        return self


def _env(name: str, default: str) -> str:
    return os.environ.get(f"SPLITFIRE_ROUTER_{name.upper()}", default)


def _list_env(name: str) -> list[str]:
    v = os.environ.get(f"SPLITFIRE_ROUTER_{name.upper()}", "")
    return [x for x in v.replace(",", " ").split() if x]


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=_env("host", "0.0.0.0"))
    p.add_argument("--port", type=int, default=int(_env("port", "8000")))
    p.add_argument("--model", default=os.environ.get("SPLITFIRE_MODEL"), help="model whose tokenizer and chat template to use (env SPLITFIRE_MODEL)")
    p.add_argument("--served-model-name", default=_env("served_model_name", ""), help="model name clients send (default: the model's)")
    p.add_argument("--extra-model", action="append", default=[], metavar="NAME=MODEL",
                   help="another model behind this router (repeatable): requests naming NAME go to the workers "
                        "that serve MODEL (they report its directory's name)")
    p.add_argument("--prefill", nargs="*", action="extend", default=_list_env("prefill"), metavar="HOST:PORT", help="prefill workers")
    p.add_argument("--decode", nargs="*", action="extend", default=_list_env("decode"), metavar="HOST:PORT", help="decode workers")
    p.add_argument("--colocated", nargs="*", action="extend", default=_list_env("colocated"), metavar="HOST:PORT", help="colocated (serve) workers")
    p.add_argument("--openai-upstream", nargs="*", action="extend", default=_list_env("openai_upstream"), metavar="URL",
                   help="OpenAI-compatible servers to balance across (vLLM, SGLang, llama.cpp)")
    p.add_argument("--openai-upstream-api-key", default=_env("openai_upstream_api_key", ""), metavar="KEY",
                   help="Bearer token for the upstreams (prefer env SPLITFIRE_ROUTER_OPENAI_UPSTREAM_API_KEY: "
                   "flags show in ps)")
    p.add_argument("--discover-dns", nargs="*", action="extend", default=_list_env("discover_dns"), metavar="ROLE=HOST:PORT",
                   help="resolve a headless Service's A records for workers of a role")
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", ""), help="affinity pins and worker registry (env REDIS_URL)")
    p.add_argument("--redis-wait", type=float, default=float(_env("redis_wait", "60")),
                   help="seconds to keep retrying an unreachable Redis at start before exiting (a Redis pod "
                   "starting beside the router); 0 = fail at once")
    p.add_argument("--policy", default=_env("policy", "token"), choices=POLICIES)
    p.add_argument("--no-prefix-aware", action="store_true", help="ignore prefix-cache locality when placing")
    p.add_argument("--reuse-port", action="store_true",
                   help="bind with SO_REUSEPORT so several router replicas share the port (the kernel spreads "
                        "connections over them)")
    p.add_argument("--no-kv-events", action="store_true",
                   help="with --redis-url, do not build the exact prefix index from the workers' KV events (keep the "
                        "per-replica approximation)")
    p.add_argument("--prefix-index-blocks", type=int, default=int(_env("prefix_index_blocks", "65536")),
                   help="block hashes remembered per endpoint for prefix-aware placement")
    p.add_argument("--shared-kv-store", action="store_true", default=_env("shared_kv_store", "") == "1",
                   help="the workers share a KV store (their --kv-store): a prefix cached on any worker costs a "
                        "fetch, not a recompute, on the others (env SPLITFIRE_ROUTER_SHARED_KV_STORE=1)")
    p.add_argument("--affinity-ttl", type=float, default=float(_env("affinity_ttl", "1800")), help="seconds a session pin lives")
    p.add_argument("--max-concurrency", type=int, default=int(_env("max_concurrency", "256")))
    p.add_argument("--max-queue", type=int, default=int(_env("max_queue", "512")))
    p.add_argument("--max-retries", type=int, default=int(_env("max_retries", "2")))
    p.add_argument("--max-body-bytes", type=int, default=int(_env("max_body_bytes", str(4 * 2**20))))
    p.add_argument("--api-keys", default=_env("api_keys", ""), help="API keys: 'key tenant' lines, or JSON {\"keys\": {KEY: {tenant, weight, max_concurrent, "
                   "requests_per_minute, tokens_per_minute, models, admin}}}; enables auth; re-read on SIGHUP")
    p.add_argument("--health-interval", type=float, default=float(_env("health_interval", "2.0")))
    p.add_argument("--enable-cache-reset", action="store_true", default=_env("enable_cache_reset", "") == "1",
                   help="serve POST /reset_prefix_cache (every worker forgets its cached prefixes; for benchmarks)")
    p.add_argument("--early-headers", action="store_true", default=_env("early_headers", "") == "1",
                   help="streams answer 200 at once (before the first token) instead of with it; a request that "
                        "fails before its first token then ends with an error event, not an HTTP status")
    p.add_argument("--keepalive-timeout", type=float, default=float(_env("keepalive_timeout", "15")),
                   help="seconds an idle client connection is kept, and the most a new one may take to send its "
                        "request head (slow-header clients are dropped)")
    p.add_argument("--worker-stream", default=_env("worker_stream", "mux"), choices=("mux", "http", "grpc"),
                   help="read workers' token streams all on one connection to each worker's HTTP port (mux: a "
                        "step's tokens in one read), one HTTP stream each (length-prefixed frames), or over gRPC")
    p.add_argument("--stream-relay", default=_env("stream_relay", "direct"), choices=("direct", "queued"),
                   help="direct: a mux stream's plain tokens are rendered and written to the client from the worker "
                        "connection's read (no task switch per token); queued: every token through the stream's "
                        "reader (the reference path)")
    p.add_argument("--breaker-error-rate", type=float, default=float(_env("breaker_error_rate", "0.5")),
                   help="eject an endpoint when this share of its last 20 requests failed (or 3 in a row)")
    p.add_argument("--breaker-open-s", type=float, default=float(_env("breaker_open_s", "2.0")),
                   help="seconds an ejected endpoint waits before a probe request (doubling per failed probe)")


def router_config_from(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        host=args.host, port=args.port, model=args.model, served_model_name=args.served_model_name,
        extra_models=list(args.extra_model),
        prefill=list(args.prefill), decode=list(args.decode), colocated=list(args.colocated),
        openai_upstream=list(args.openai_upstream), openai_upstream_api_key=args.openai_upstream_api_key,
        discover_dns=list(args.discover_dns), redis_url=args.redis_url, redis_wait_s=args.redis_wait,
        policy=args.policy, prefix_aware=not args.no_prefix_aware, prefix_index_blocks=args.prefix_index_blocks,
        shared_kv_store=args.shared_kv_store, kv_events=not args.no_kv_events, reuse_port=args.reuse_port, affinity_ttl_s=args.affinity_ttl,
        max_concurrency=args.max_concurrency, max_queue=args.max_queue, max_retries=args.max_retries,
        max_body_bytes=args.max_body_bytes, api_keys_file=args.api_keys, health_interval_s=args.health_interval,
        keepalive_timeout_s=args.keepalive_timeout, early_headers=args.early_headers,
        enable_cache_reset=args.enable_cache_reset, worker_stream=args.worker_stream,
        stream_relay=args.stream_relay, breaker_error_rate=args.breaker_error_rate, breaker_open_s=args.breaker_open_s,
    ).validate()
