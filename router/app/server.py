"""The router process: its parts wired together, the HTTP routes, start-up and shutdown.

Parts, by room: `api/` parses and formats the wire formats; `core/` holds the fleet's state (endpoints
and their load, breakers, affinity pins, prefix index, model pools); `backends/` talk to workers and
OpenAI-compatible upstreams; `placement/` picks endpoints, retries and resumes; `tenancy/` knows keys,
quotas and admission; here in `app/`, the serving path (`serving.py`), the model catalogue's routes
(`model_routes.py`), LoRA administration (`adapters.py`) and the direct relay.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import time
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from common.tokenizer import Tokenizer
from common.tracing import Tracing
from router.api import messages
from router.api.errors import APIError
from router.api.protocol import RequestParser
from router.api.sse import OpenAIFormat
from router.app.adapters import AdapterAdmin
from router.app.batch_routes import BatchRoutes
from router.app.model_routes import ModelRoutes
from router.app.serving import ServingPath
from router.backends.backend import Backends
from router.backends.openai_upstream import OpenAIUpstreamClient
from router.backends.worker_client import WorkerClient
from router.batch.runner import BatchRunner, Lease
from router.batch.store import Batches, Files
from router.core.affinity import MemoryPinStore, RedisPinStore, SessionAffinity
from router.core.config import RouterConfig
from router.core.discovery import dns_discovery, redis_discovery
from router.core.endpoints import EndpointRegistry
from router.core.metrics import RouterMetrics
from router.core.model_pools import ModelPool, ModelPools, load_model
from router.core.prefix_index import PrefixIndex, PrefixLookup
from router.placement.balancer import make_policy
from router.placement.dispatcher import Dispatcher
from router.placement.health import HealthChecker
from router.placement.kv_events import ExactPrefixIndex, KVIndexCollector
from router.tenancy.admission import Admission
from router.tenancy.quotas import PipelinedCounters, Quotas
from router.tenancy.redis_pipe import PipelinedRedis
from router.tenancy.tenants import Tenants

log = logging.getLogger("splitfire.router")


try:
    VERSION = importlib.metadata.version("splitfire")
except importlib.metadata.PackageNotFoundError:  # running from a checkout that was never installed
    VERSION = "0.1.0+checkout"


def load_model_info(cfg: RouterConfig) -> tuple[Tokenizer | None, str, int]:
    """Tokenizer, served model name and context length. Upstream-only routers may run without a
    model; without --served-model-name they serve what the upstreams' /v1/models list ("")."""
    if cfg.model is None and cfg.openai_upstream and not (cfg.decode or cfg.colocated or cfg.prefill):
        return None, cfg.served_model_name, 1 << 30
    model_dir, tokenizer, max_len = load_model(cfg.model)
    if cfg.extra_models:
        cfg.model = model_dir  # (its workers are known by the resolved directory's name)
    return tokenizer, cfg.served_model_name or Path(model_dir).name, max_len


def load_extra_models(cfg: RouterConfig) -> list[tuple[str, str, Tokenizer, int]]:
    """--extra-model NAME=MODEL: (served name, directory, tokenizer, context length) each."""
    return [(name, *load_model(model)) for name, model in cfg.extra_model_specs()]


class Router:
    def __init__(self, cfg: RouterConfig, tokenizer: Tokenizer | None, model_name: str, max_model_len: int,
                 extra: list[tuple[str, str, Tokenizer, int]] | None = None):
        """`extra`: more models behind this router, (served name, directory, tokenizer, context length) each."""
        self.cfg = cfg
        self.registry = EndpointRegistry(cfg.block_size, cfg.breaker())
        for role, addrs in (("prefill", cfg.prefill), ("decode", cfg.decode), ("colocated", cfg.colocated),
                            ("openai", cfg.openai_upstream)):
            for a in addrs:
                self.registry.add(a, role)
        self.metrics = RouterMetrics(self.registry)
        self.tenants = Tenants.from_file(cfg.api_keys_file)
        self.pools = self._model_pools(cfg, tokenizer, model_name, max_model_len, extra or [])
        self.admission = Admission(cfg.max_concurrency, cfg.max_queue, cfg.queue_timeout_s, self.metrics)
        self.workers = WorkerClient(cfg.worker_stream)
        self.backends = Backends(self.workers, OpenAIUpstreamClient(cfg.openai_upstream_api_key))
        self.redis = None
        if cfg.redis_url:
            import redis.asyncio as aioredis

            self.redis = aioredis.from_url(cfg.redis_url)
        self.quota_redis = PipelinedRedis(cfg.redis_url) if cfg.redis_url else None
        self.quotas = Quotas(PipelinedCounters(self.quota_redis) if self.quota_redis is not None else None)
        store = RedisPinStore(self.redis) if self.redis is not None else MemoryPinStore()
        self.affinity = SessionAffinity(store, cfg.affinity_ttl_s)
        approximate = PrefixIndex(cfg.prefix_index_blocks, cfg.shared_kv_store)
        index: PrefixLookup = approximate
        self.kv_index: ExactPrefixIndex | None = None
        if cfg.redis_url and cfg.kv_events and cfg.prefix_aware:
            import redis.asyncio as aioredis

            # Its own connection: the stream reads block for a moment at a time.
            self.kv_index = index = ExactPrefixIndex(approximate, self.registry, self.workers,
                                                     aioredis.from_url(cfg.redis_url), cfg.health_timeout_s)
        if self.kv_index is not None:
            self.metrics.registry.register(KVIndexCollector(self.kv_index))
        self.tracing = Tracing.from_env("splitfire-router", {"splitfire.router.policy": cfg.policy})
        self.dispatcher = Dispatcher(cfg, self.registry, make_policy(cfg.policy), self.affinity, index, self.backends,
                                     self.metrics, tokenizer, self.tracing)
        self.dispatcher.pool_tokenizers = {p.worker_model: p.tokenizer for p in self.pools.pools.values()}
        self.health = HealthChecker(cfg, self.registry, self.backends,
                                    None if model_name else self.pools.model_names,
                                    on_adapters=lambda: self.pools.refresh_adapters(self.registry.all()))
        self.serving = ServingPath(cfg, self.pools, self.tenants, self.quotas, self.admission, self.dispatcher,
                                   self.metrics, self.tracing)
        self.model_routes = ModelRoutes(self.pools, self.tenants)
        root = Path(cfg.files_root())
        self.files = Files(root, cfg.max_file_bytes, cfg.max_files_per_tenant)
        self.batches = Batches(root, cfg.max_batches_per_tenant)
        self.batch_routes = BatchRoutes(self.tenants, self.files, self.batches)
        self.batch_runner = BatchRunner(self.batches, self.files, self.serving.answer,
                                        Lease(self.redis, self.batches.dir, cfg.batch_lease_s),
                                        cfg.batch_concurrency, cfg.batch_priority,
                                        busy=lambda: self.admission.outranked(cfg.batch_priority),
                                        busy_concurrency=cfg.batch_busy_concurrency,
                                        pause_s=cfg.batch_busy_pause_s)
        self.adapters = AdapterAdmin(cfg, self.pools, self.registry, self.workers, self.tenants)
        self._tasks: list[asyncio.Task] = []

    @staticmethod
    def _model_pools(cfg: RouterConfig, tokenizer: Tokenizer | None, model_name: str, max_model_len: int,
                     extra: list[tuple[str, str, Tokenizer, int]]) -> ModelPools:
        """The served models, each with its own parser and reply format (its tokenizer and chat template)."""
        upstream_only = bool(cfg.openai_upstream) and not (cfg.decode or cfg.colocated or cfg.prefill)
        names: set[str] = set()  # (every parser checks `model` against the one set of served names)

        def pool(name: str, root: str, tok: Tokenizer | None, max_len: int) -> ModelPool:
            return ModelPool(name, root, tok, max_len, RequestParser(tok, names, max_len, upstream_only),
                             OpenAIFormat(tok))

        pools = ModelPools(pool(model_name, str(cfg.model or ""), tokenizer, max_model_len),
                           [pool(*e) for e in extra])
        names |= pools.model_names
        pools.model_names = names
        return pools

    # -- app ----------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes, middlewares=[self._errors])
        for method, path, handler in (
                ("POST", "/v1/chat/completions", self.serving.chat),
                ("POST", "/v1/completions", self.serving.completions),
                ("POST", "/v1/responses", self.serving.responses),
                ("POST", "/v1/messages", self.serving.messages),
                ("POST", "/v1/messages/count_tokens", self.serving.count_tokens),
                ("GET", "/v1/models", self.model_routes.models),
                ("GET", "/v1/models/{model_id:.+}", self.model_routes.model),
                ("POST", "/tokenize", self.model_routes.tokenize),
                ("POST", "/detokenize", self.model_routes.detokenize),
                ("GET", "/version", self.version),
                ("POST", "/reset_prefix_cache", self.reset_prefix_cache),
                ("POST", "/v1/load_lora_adapter", self.adapters.load),
                ("POST", "/v1/unload_lora_adapter", self.adapters.unload),
                ("GET", "/ping", self.ping),
                ("POST", "/ping", self.ping),
                ("GET", "/health", self.health_route),
                ("GET", "/metrics", self.metrics_route),
                *self.batch_routes.routes()):
            app.router.add_route(method, path, handler)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        if self.redis is not None:
            await self._wait_for_redis()
        await self.health.check_all()
        self._tasks.append(asyncio.create_task(self.health.run()))
        if self.redis is not None:
            self._tasks.append(asyncio.create_task(redis_discovery(self.redis, self.registry)))
        if self.cfg.discover_dns:
            self._tasks.append(asyncio.create_task(dns_discovery(self.cfg.discover_dns, self.registry)))
        if self.tenants.path:
            self._tasks.append(asyncio.create_task(self.tenants.watch()))
        if self.kv_index is not None:
            self._tasks.append(asyncio.create_task(self.kv_index.run()))
        self._tasks.append(asyncio.create_task(self.batch_runner.run()))

    async def _wait_for_redis(self) -> None:
        """Redis answering, retried with backoff for `redis_wait_s` (in a cluster it may start after the
        router); then the start fails naming it."""
        deadline = time.monotonic() + self.cfg.redis_wait_s
        delay = 0.25
        while True:
            try:
                await self.redis.ping()  # type: ignore[union-attr]
                return
            except Exception as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise OSError(f"cannot reach Redis at {self.cfg.redis_url} (waited {self.cfg.redis_wait_s:.0f} s, "
                                  f"--redis-wait): {e}") from e
                log.info("event=redis_unreachable url=%s retry_in_s=%.2f error=%s", self.cfg.redis_url,
                         min(delay, left), e)
                await asyncio.sleep(min(delay, left))
                delay = min(delay * 2, 5.0)

    async def _stop(self, app: web.Application) -> None:
        await self.batch_runner.stop()  # (its batches resume on the next replica, or this one restarted)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.backends.close()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)  # (exports what is queued)
        if self.redis is not None:
            await self.redis.aclose()
        if self.quota_redis is not None:
            await self.quota_redis.aclose()
        if self.kv_index is not None:
            await self.kv_index.redis.aclose()

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
        try:
            resp = await handler(request)
        except APIError as e:
            resp = _error_response(request, e)
        except web.HTTPRequestEntityTooLarge:
            resp = _error_response(request, APIError(413, f"request body exceeds {self.cfg.max_body_bytes} bytes", code="body_too_large"))
        except web.HTTPMethodNotAllowed:
            resp = _error_response(request, APIError(405, f"method {request.method} not allowed on {request.path}"))
        except web.HTTPNotFound:
            resp = _error_response(request, APIError(404, f"no route {request.method} {request.path}", code="not_found"))
        except web.HTTPException as e:
            resp = _error_response(request, APIError(e.status, e.reason or "error"))
        except asyncio.CancelledError:
            self.metrics.child(self.metrics.requests, route, "499").inc()
            raise
        except Exception as e:  # a bug: log loudly with context, answer in OpenAI's shape
            log.exception("event=internal_error path=%s", request.path)
            resp = _error_response(request, APIError(500, f"internal error: {type(e).__name__}", type_="server_error"))
        self.metrics.child(self.metrics.requests, route, str(resp.status)).inc()
        return resp

    # -- operations -----------------------------------------------------------------------

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """Every endpoint forgets its cached prefixes (benchmarks reset between runs). Off unless
        --enable-cache-reset (any client could otherwise wipe every tenant's cache); with --api-keys,
        only for keys marked admin."""
        self.tenants.admin(request)
        if not self.cfg.enable_cache_reset:
            raise APIError(403, "resetting the prefix cache is disabled; start the router with --enable-cache-reset",
                           type_="permission_error", code="cache_reset_disabled")
        eps = self.registry.all()

        async def one(ep) -> dict[str, Any]:
            try:
                said = await self.backends.of(ep).reset_prefix_cache(ep, self.cfg.health_timeout_s * 5)
                return {"role": ep.role, "address": ep.address, "ok": True, "detail": said}
            except Exception as e:  # reported per endpoint; the status says whether all of them did it
                return {"role": ep.role, "address": ep.address, "ok": False, "detail": f"{type(e).__name__}: {e}"}

        results = await asyncio.gather(*(one(ep) for ep in eps))
        self.dispatcher.index.clear()
        ok = all(r["ok"] for r in results)
        log.info("event=prefix_cache_reset endpoints=%d ok=%s", len(results), ok)
        return web.json_response({"reset": ok, "endpoints": results}, status=200 if ok else 502)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VERSION})

    async def ping(self, request: web.Request) -> web.Response:
        """Liveness of the router process itself (/health also says whether workers can serve)."""
        return web.Response(status=200)

    async def health_route(self, request: web.Request) -> web.Response:
        eps = self.registry.all()
        ready = any(e.healthy and e.role in ("decode", "colocated", "openai") for e in eps)
        body: dict[str, Any] = {"status": "ok" if ready else "no_healthy_workers",
                                "endpoints": [{"role": e.role, "address": e.address, "healthy": e.healthy,
                                               "load": e.load()} for e in eps]}
        if self.kv_index is not None:  # the exact index's view of each worker (router/kv_events.py)
            for e in body["endpoints"]:
                v = self.kv_index.views.get(e["address"])
                e["kv_index"] = {"synced": bool(v and v.synced), "blocks": len(v.blocks) if v else 0,
                                 "seq": v.seq if v else 0}
        return web.json_response(body, status=200 if ready else 503)

    async def metrics_route(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


__all__ = ["Router", "load_extra_models", "load_model_info"]


def _error_response(request: web.Request, e: APIError) -> web.Response:
    """OpenAI's error shape, or Anthropic's on its routes."""
    return messages.error_response(e) if request.path.startswith("/v1/messages") else e.response()
