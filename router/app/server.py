"""The aiohttp application: OpenAI routes, /health, /metrics, and background loops."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import json
import logging
import re
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from common.chat_template import TemplateError
from common.tokenizer import Tokenizer
from router.api import responses
from router.api.chunks import Chunk, merge_delta_extra, merge_logprobs
from router.api.errors import APIError, bad_request, not_found, unavailable
from router.api.protocol import GenRequest, RequestParser, parse_messages
from router.api.sse import ChoiceWriter, OpenAIFormat, ReplyFormat, usage_dict, with_usage
from router.app.direct_relay import DirectStream
from router.backends.backend import Backends
from router.backends.openai_upstream import OpenAIUpstreamClient
from router.backends.worker_client import WorkerClient
from router.core.affinity import MemoryPinStore, RedisPinStore, SessionAffinity
from router.core.config import RouterConfig
from router.core.discovery import dns_discovery, redis_discovery
from router.core.endpoints import EndpointRegistry
from router.core.metrics import RouterMetrics
from router.core.model_pools import ModelPool, check_distinct, load_model
from router.core.prefix_index import PrefixIndex, PrefixLookup
from router.placement.balancer import make_policy
from router.placement.dispatcher import Dispatcher, Latency
from router.placement.health import HealthChecker
from router.placement.kv_events import ExactPrefixIndex, KVIndexCollector
from router.tenancy.admission import Admission
from router.tenancy.quotas import PipelinedCounters, Quotas
from router.tenancy.redis_pipe import PipelinedRedis
from router.tenancy.tenants import Caller, Tenants

log = logging.getLogger("splitfire.router")


try:
    VERSION = importlib.metadata.version("splitfire")
except importlib.metadata.PackageNotFoundError:  # running from a checkout that was never installed
    VERSION = "0.1.0+checkout"
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _no_constant(name: str) -> None:
    raise json.JSONDecodeError(f"{name} is not JSON", name, 0)


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
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.model_root = str(cfg.model or "")
        self.started = int(time.time())
        # The names clients may ask for; learned from the upstreams when none is configured.
        self.model_names: set[str] = {model_name} if model_name else set()
        self.base_name = model_name
        self.adapter_names: set[str] = set()  # LoRA adapters resident on some worker (also in model_names)
        self.registry = EndpointRegistry(cfg.block_size, cfg.breaker())
        for role, addrs in (("prefill", cfg.prefill), ("decode", cfg.decode), ("colocated", cfg.colocated),
                            ("openai", cfg.openai_upstream)):
            for a in addrs:
                self.registry.add(a, role)
        self.metrics = RouterMetrics(self.registry)
        self.tenants = Tenants.from_file(cfg.api_keys_file)
        upstream_only = bool(cfg.openai_upstream) and not (cfg.decode or cfg.colocated or cfg.prefill)
        self.parser = RequestParser(tokenizer, self.model_names, max_model_len, upstream_only)
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
        self.dispatcher = Dispatcher(cfg, self.registry, make_policy(cfg.policy), self.affinity, index, self.backends,
                                     self.metrics, tokenizer)
        self.openai_format = OpenAIFormat(tokenizer)
        self.default_pool = ModelPool(model_name, self.model_root, tokenizer, max_model_len, self.parser,
                                      self.openai_format)
        self.pools: dict[str, ModelPool] = {model_name: self.default_pool}
        for name, root, tok, max_len in extra or []:
            self.pools[name] = ModelPool(name, root, tok, max_len,
                                         RequestParser(tok, self.model_names, max_len, upstream_only), OpenAIFormat(tok))
            self.model_names.add(name)
        check_distinct(list(self.pools.values()))
        # Several models: each request carries its pool (the workers reporting its model), and a LoRA
        # adapter belongs to the pool whose workers hold it.
        self.multi = len(self.pools) > 1
        self.adapter_pool: dict[str, str] = {}
        self.dispatcher.pool_tokenizers = {p.worker_model: p.tokenizer for p in self.pools.values()}
        self.health = HealthChecker(cfg, self.registry, self.backends, None if model_name else self.model_names,
                                    on_adapters=self._refresh_adapters)
        self._tasks: list[asyncio.Task] = []

    # -- app ----------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes, middlewares=[self._errors])
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model_id:.+}", self.model)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/version", self.version)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        app.router.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        app.router.add_get("/ping", self.ping)
        app.router.add_post("/ping", self.ping)
        app.router.add_get("/health", self.health_route)
        app.router.add_get("/metrics", self.metrics_route)
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
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.backends.close()
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
            resp = e.response()
        except web.HTTPRequestEntityTooLarge:
            resp = APIError(413, f"request body exceeds {self.cfg.max_body_bytes} bytes", code="body_too_large").response()
        except web.HTTPMethodNotAllowed:
            resp = APIError(405, f"method {request.method} not allowed on {request.path}").response()
        except web.HTTPNotFound:
            resp = APIError(404, f"no route {request.method} {request.path}", code="not_found").response()
        except web.HTTPException as e:
            resp = APIError(e.status, e.reason or "error").response()
        except asyncio.CancelledError:
            self.metrics.child(self.metrics.requests, route, "499").inc()
            raise
        except Exception as e:  # a bug: log loudly with context, answer in OpenAI's shape
            log.exception("event=internal_error path=%s", request.path)
            resp = APIError(500, f"internal error: {type(e).__name__}", type_="server_error").response()
        self.metrics.child(self.metrics.requests, route, str(resp.status)).inc()
        return resp

    async def _body(self, request: web.Request) -> Any:
        raw = await request.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise bad_request(f"request body is not valid UTF-8 (byte {e.start})") from e
        try:
            body = json.loads(text, parse_constant=_no_constant)
        except json.JSONDecodeError as e:
            raise bad_request(f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from e
        except RecursionError as e:
            raise bad_request("request body nests JSON too deeply") from e
        if _SURROGATE_ESCAPE.search(text):  # a \uD8xx escape: fine in a pair, not alone
            try:
                json.dumps(body, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError as e:
                raise bad_request("request body has a lone UTF-16 surrogate escape (\\ud800-\\udfff) in a string") from e
        return body

    # -- routes -------------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        caller = self.tenants.caller(request)
        body = self._scoped(caller, await self._body(request))
        pool = self._pool_for(body)
        reqs = self._pooled(pool, pool.parser.chat(body, caller.tenant, request.headers.get("x-session-affinity")))
        return await self._serve(request, reqs, caller, pool.openai_format)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        caller = self.tenants.caller(request)
        body = self._scoped(caller, await self._body(request))
        pool = self._pool_for(body)
        reqs = self._pooled(pool, pool.parser.completions(body, caller.tenant,
                                                          request.headers.get("x-session-affinity")))
        return await self._serve(request, reqs, caller, pool.openai_format)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """The Responses API (router/responses.py): the chat path underneath, Responses shapes out."""
        caller = self.tenants.caller(request)
        body = self._scoped(caller, await self._body(request))
        if self.parser.upstream_only:
            raise bad_request("this router fronts OpenAI-compatible upstreams only; send /v1/responses to them, or "
                              "use /v1/chat/completions here")
        chat_body = responses.to_chat(body)
        pool = self._pool_for(chat_body)
        req = self._pooled(pool, pool.parser.chat(chat_body, caller.tenant,
                                                  request.headers.get("x-session-affinity")))[0]
        return await self._serve(request, [req], caller, responses.ResponsesFormat(req, body))

    def _pool_for(self, body: Any) -> ModelPool:
        """The model a body names (an adapter: the model whose workers hold it); any other name gets the
        first model's parser, which answers it with the 404 naming what exists."""
        model = body.get("model") if isinstance(body, dict) else None
        if isinstance(model, str) and self.multi:
            if model in self.pools:
                return self.pools[model]
            if model in self.adapter_pool:
                return self.pools[self.adapter_pool[model]]
        return self.default_pool

    def _pooled(self, pool: ModelPool, reqs: list[GenRequest]) -> list[GenRequest]:
        if self.multi:
            for r in reqs:
                r.pool = pool.worker_model
        return reqs

    def _visible(self, caller: Caller) -> list[str]:
        return sorted(n for n in self.model_names if caller.policy.may_use(n))

    def _scoped(self, caller: Caller, body: Any) -> Any:
        """A key limited to some models asking for another gets the 404 of a model that does not
        exist, naming only the models it may use (other names do not leak)."""
        if caller.policy.models is not None and isinstance(body, dict) and isinstance(body.get("model"), str):
            model = body["model"]
            if model not in self.model_names or not caller.policy.may_use(model):
                raise not_found(f"model '{model}' does not exist; available: {self._visible(caller)}",
                                code="model_not_found")
        return body

    def _model_card(self, name: str) -> dict[str, Any]:
        adapter = name in self.adapter_names
        pool = self.pools.get(self.adapter_pool.get(name, self.base_name) if adapter else name, self.default_pool)
        return {"id": name, "object": "model", "created": self.started, "owned_by": "splitfire",
                "root": name if adapter else pool.root or name, "parent": pool.name if adapter else None,
                "max_model_len": pool.max_model_len, "permission": []}

    # -- LoRA adapters ------------------------------------------------------------------

    def _refresh_adapters(self) -> None:
        """The adapters some worker holds become model names (a request naming one runs under it)."""
        names: set[str] = set()
        for ep in self.registry.all():
            if ep.role != "openai":
                names |= ep.adapters
        names -= set(self.pools)
        self.model_names -= self.adapter_names - names
        self.model_names |= names
        self.adapter_names = names
        if self.multi:
            by_worker = {p.worker_model: p.name for p in self.pools.values()}
            self.adapter_pool = {a: by_worker[base] for ep in self.registry.all() if ep.role != "openai"
                                 for a in ep.adapters if (base := ep.adapter_models.get(a, ep.served_model)) in by_worker}

    def _adapter_base(self, body: Any) -> ModelPool | None:
        """With several models, the load route's `model` names the adapter's base model (its workers
        load it); with one it may be left out."""
        model = body.pop("model", None) if isinstance(body, dict) else None
        if model is None:
            if self.multi:
                raise bad_request(f"'model' is required: this router serves several models; name the adapter's base "
                                  f"model, one of {sorted(self.pools)}", param="model")
            return None
        if not isinstance(model, str) or model not in self.pools:
            raise bad_request(f"'model' must name a served base model, one of {sorted(self.pools)}", param="model")
        return self.pools[model]

    def _adapter_body(self, body: Any, fields: tuple[str, ...]) -> list[str]:
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        unknown = sorted(set(body) - set(fields))
        if unknown:
            raise bad_request(f"unknown field '{unknown[0]}'; this route takes {', '.join(fields)}", param=unknown[0])
        out = []
        for f in fields:
            v = body.get(f)
            if not isinstance(v, str) or not v:
                raise bad_request(f"'{f}' must be a non-empty string", param=f)
            out.append(v)
        return out

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's route: every worker (prefill, decode, colocated) loads the adapter from `lora_path`, which
        must lie under the workers' --lora-root; with --api-keys only admin keys may. All or none: a
        worker refusing it (a 400 naming why) unloads it from those that took it."""
        self.tenants.admin(request)
        body = await self._body(request)
        base = self._adapter_base(body)
        name, path = self._adapter_body(body, ("lora_name", "lora_path"))
        if name in self.model_names:
            raise bad_request(f"'{name}' is already served (the base model or a loaded adapter)", param="lora_name")
        eps = [ep for ep in self.registry.all() if ep.role != "openai"
               and (base is None or ep.serves(base.worker_model))]
        if not eps:
            raise unavailable("no workers to load the adapter on")
        timeout = self.cfg.health_timeout_s * 20
        model = base.worker_model if base is not None else ""
        results = await asyncio.gather(*(self.workers.load_adapter(ep, name, path, timeout, model) for ep in eps),
                                       return_exceptions=True)
        failed = [(ep, r) for ep, r in zip(eps, results, strict=True) if isinstance(r, BaseException)]
        if failed:
            took = [ep for ep, r in zip(eps, results, strict=True) if not isinstance(r, BaseException)]
            await asyncio.gather(*(self.workers.unload_adapter(ep, name, timeout) for ep in took),
                                 return_exceptions=True)
            ep, err = failed[0]
            log.warning("event=lora_load_failed name=%s path=%s endpoint=%s error=%s", name, path, ep.address, err)
            if isinstance(err, APIError):
                raise err
            raise APIError(502, f"worker {ep.address} could not load adapter '{name}': {err}", type_="upstream_error")
        for ep in eps:
            ep.adapters.add(name)
            if ep.hosted and model:
                ep.adapter_models[name] = model
        self._refresh_adapters()
        log.info("event=lora_loaded name=%s path=%s endpoints=%d", name, path, len(eps))
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """Every worker holding it stops taking requests for it; requests running under it finish."""
        self.tenants.admin(request)
        (name,) = self._adapter_body(await self._body(request), ("lora_name",))
        if name not in self.adapter_names:
            raise not_found(f"LoRA adapter '{name}' is not loaded", code="model_not_found")
        eps = [ep for ep in self.registry.all() if name in ep.adapters]
        timeout = self.cfg.health_timeout_s * 20
        results = await asyncio.gather(*(self.workers.unload_adapter(ep, name, timeout) for ep in eps),
                                       return_exceptions=True)
        for ep, r in zip(eps, results, strict=True):
            if isinstance(r, BaseException):
                log.warning("event=lora_unload_failed name=%s endpoint=%s error=%s", name, ep.address, r)
            ep.adapters.discard(name)
            ep.adapter_models.pop(name, None)
        self._refresh_adapters()
        log.info("event=lora_unloaded name=%s endpoints=%d", name, len(eps))
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def models(self, request: web.Request) -> web.Response:
        caller = self.tenants.caller(request)
        return web.json_response({"object": "list", "data": [self._model_card(n) for n in self._visible(caller)]})

    async def model(self, request: web.Request) -> web.Response:
        caller = self.tenants.caller(request)
        name = request.match_info["model_id"]
        if name not in self.model_names or not caller.policy.may_use(name):
            raise not_found(f"model '{name}' does not exist; available: {self._visible(caller)}",
                            code="model_not_found")
        return web.json_response(self._model_card(name))

    def _tokenizer_for(self, caller: Caller, body: Any) -> Tokenizer:
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        model = body.get("model")
        if model is not None and (model not in self.model_names or not caller.policy.may_use(model)):
            raise not_found(f"model '{model}' does not exist; available: {self._visible(caller)}",
                            code="model_not_found")
        tok = self._pool_for(body).tokenizer
        if tok is None:
            raise bad_request("this router has no tokenizer (it fronts OpenAI-compatible upstreams without --model); "
                              "ask the upstreams, or start the router with --model")
        return tok

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: {prompt} or {messages, add_generation_prompt}; add_special_tokens."""
        caller = self.tenants.caller(request)
        body = await self._body(request)
        tok = self._tokenizer_for(caller, body)
        special = body.get("add_special_tokens", "messages" not in body)
        if not isinstance(special, bool):
            raise bad_request("'add_special_tokens' must be a boolean", param="add_special_tokens")
        if "messages" in body:
            gen = body.get("add_generation_prompt", True)
            if not isinstance(gen, bool):
                raise bad_request("'add_generation_prompt' must be a boolean", param="add_generation_prompt")
            try:
                ids = tok.encode_chat(parse_messages(body), add_generation_prompt=gen)
            except TemplateError as e:
                raise bad_request(f"chat template rejected the conversation: {e}", param="messages") from e
        elif isinstance(body.get("prompt"), str):
            ids = tok.encode(body["prompt"], add_special_tokens=special)
        else:
            raise bad_request("give 'prompt' (a string) or 'messages'", param="prompt")
        return web.json_response({"count": len(ids), "max_model_len": self._pool_for(body).max_model_len, "tokens": ids,
                                  "token_strs": None})

    async def detokenize(self, request: web.Request) -> web.Response:
        caller = self.tenants.caller(request)
        body = await self._body(request)
        tok = self._tokenizer_for(caller, body)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                and 0 <= t < tok.vocab_size for t in ids):
            raise bad_request(f"'tokens' must be a list of token ids in [0, {tok.vocab_size})", param="tokens")
        return web.json_response({"prompt": tok.decode(ids)})

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

    # -- serving --------------------------------------------------------------------------

    async def _serve(self, request: web.Request, reqs: list[GenRequest], caller: Caller,
                     fmt: ReplyFormat | None = None) -> web.StreamResponse:
        fmt = fmt or self.openai_format
        tenant, policy = caller.tenant, caller.policy
        self.metrics.prompt_tokens.inc(sum(len(r.prompt_token_ids) for r in reqs))
        self.metrics.requests_started.inc()
        # What the request will use, as far as it is known: the prompt now, the completion at the end
        # (a request that fails part-way is charged its prompt).
        used = {"prompt": sum(len(r.prompt_token_ids) for r in reqs if r.sample_index == 0), "completion": 0}
        reservation = None
        if policy.limited:
            body = reqs[0].body
            budget = (sum(r.sampling.max_tokens for r in reqs) if body.get("max_tokens") is not None
                      or body.get("max_completion_tokens") is not None else 0)
            try:
                reservation = await self.quotas.admit(caller, used["prompt"], budget)
            except APIError as e:
                self.metrics.tenants.throttle(tenant, e.param or "")
                log.info("event=request_throttled tenant=%s key=%s limit=%s", tenant, caller.key_id, e.param)
                raise
        if policy.weight != 1.0:
            for r in reqs:
                r.weight = policy.weight
        if reqs[0].model in self.adapter_names:
            for r in reqs:
                r.adapter = r.model
        try:
            queued = time.perf_counter()
            async with self.admission.slot(tenant, policy.weight):
                t0 = time.perf_counter()
                self.metrics.tenants.admitted(tenant, t0 - queued)
                try:
                    if reqs[0].stream:
                        return await self._stream(request, reqs, fmt, t0, used)
                    return await self._complete(reqs, fmt, t0, used)
                finally:
                    self.metrics.e2e.observe(time.perf_counter() - t0)
                    self.metrics.tenants.used(tenant, used["prompt"], used["completion"])
                    self.metrics.models.used(reqs[0].model, used["prompt"], used["completion"])
        finally:
            if reservation is not None:
                await self.quotas.release(reservation, used["prompt"] + used["completion"])

    async def _complete(self, reqs: list[GenRequest], fmt: ReplyFormat, t0: float,
                        used: dict[str, int]) -> web.Response:
        async def one(req: GenRequest) -> dict[str, Any]:
            r: dict[str, Any] = {"text": [], "logprobs": [], "finish_reason": "stop", "prompt": 0, "completion": 0,
                                 "cached": 0, "token_ids": []}
            latency = Latency(self.metrics, t0)
            async for c in self.dispatcher.run(req):
                latency.observe(c)
                used["completion"] += len(c.token_ids)  # so far (the quota's count if it ends early)
                r["text"].append(c.text)
                r["logprobs"] += c.logprobs
                if req.reply is not None:
                    r["token_ids"] += c.token_ids
                if c.extra:
                    merge_delta_extra(r.setdefault("extra", {}), c.extra)
                if c.raw_logprobs:
                    r["raw_logprobs"] = merge_logprobs(r.get("raw_logprobs"), c.raw_logprobs)
                if c.finish_reason:
                    r["finish_reason"] = c.finish_reason
                    r["prompt"], r["completion"], r["cached"] = c.prompt_tokens, c.completion_tokens, c.cached_tokens
                    if req.sample_index:  # a prompt counts once, however many samples
                        r["prompt"] = r["cached"] = 0
            r["text"] = "".join(r["text"])
            return r

        results = await asyncio.gather(*(one(r) for r in reqs))
        self._count_usage(results, used)
        self._log_done(reqs[0], results, t0)
        if reqs[0].best_of:
            reqs, results = best_of(reqs, results)
        return web.json_response(fmt.body(reqs, results),
                                 dumps=lambda o: json.dumps(o, ensure_ascii=False),
                                 headers={"X-Request-Id": reqs[0].id, **_served_headers(reqs[0])})

    @staticmethod
    def _log_done(req: GenRequest, results: list[dict[str, Any]], t0: float, direct: DirectStream | None = None) -> None:
        pin = req.served_by
        log.info("event=request_done rid=%s kind=%s stream=%s tenant=%s end_user=%s prompt=%d completion=%d "
                 "cached=%d decode=%s prefill=%s total_ms=%.1f relayed_direct=%d relayed_reads=%d",
                 req.id, req.kind, req.stream, req.tenant, req.body.get("safety_identifier") or req.body.get("user") or "-",
                 sum(r["prompt"] for r in results), sum(r["completion"] for r in results),
                 sum(r["cached"] for r in results), pin.decode if pin else "-",
                 (pin.prefill or "-") if pin else "-", (time.perf_counter() - t0) * 1000,
                 direct.relayed if direct is not None else 0, direct.reads if direct is not None else 0)

    def _count_usage(self, results: list[dict[str, Any]], used: dict[str, int]) -> None:
        used["completion"] = completion = sum(r["completion"] for r in results)
        self.metrics.completion_tokens.inc(completion)
        self.metrics.cached_tokens.inc(sum(r["cached"] for r in results))

    async def _stream(self, request: web.Request, reqs: list[GenRequest], fmt: ReplyFormat,
                      t0: float, used: dict[str, int]) -> web.StreamResponse:
        writers = fmt.writers(reqs)
        latencies = [Latency(self.metrics, t0) for _ in reqs]
        source: AsyncGenerator[Any, None]
        direct = None
        if len(reqs) == 1:
            if self.cfg.stream_relay == "direct" and reqs[0].reply is None and not _continuous_usage(reqs[0]):
                direct = DirectStream(writers[0], latencies[0], used)
            source = self.dispatcher.run(reqs[0], direct)
        else:
            source = _merge([self.dispatcher.run(r) for r in reqs])
        try:
            return await self._write_stream(request, reqs, fmt, writers, latencies, source, t0, used, direct)
        finally:
            # Release the worker call and the load estimates now, not when the GC gets to it
            # (the client may have gone away while we were writing).
            await source.aclose()

    async def _write_stream(self, request: web.Request, reqs: list[GenRequest], fmt: ReplyFormat,
                            writers: list[ChoiceWriter], latencies: list[Latency], source, t0: float,
                            used: dict[str, int], direct: DirectStream | None = None) -> web.StreamResponse:
        # By default the head waits for the first chunk, so that failures before any token (bad
        # input found by a worker, no capacity, no workers) get a proper HTTP status. With
        # --early-headers the 200 and the role chunk leave at once (clients with short header
        # timeouts survive long prefills); retries before the first token still happen, and a
        # request that fails anyway ends with an error event instead of a status.
        early = self.cfg.early_headers
        first = None if early else await anext(source, None)
        resp = _SSEResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                     "X-Request-Id": reqs[0].id, **({} if early else _served_headers(reqs[0]))})
        await resp.prepare(request)
        if direct is not None:
            direct.attach(request, resp)
        if early:  # the head leaves with the first body bytes: the role chunks, or an SSE comment
            await resp.write(fmt.opening(reqs, writers, early=True))
            if direct is not None:
                direct.armed = True
            try:
                first = await anext(source, None)
            except APIError as e:
                log.warning("event=stream_failed rid=%s status=%d error=%r", reqs[0].id, e.status, e.message)
                await resp.write_eof(fmt.error(e.message, e.type, e.code or "worker_failed") + fmt.done)
                return resp
        usage = {"prompt": 0, "completion": 0, "cached": 0}
        # One write per upstream read: the head, the role chunk and the first text leave
        # together, and so do the last text, the finish, usage and [DONE] (a syscall each was
        # most of the router's per-request cost in front of a fast upstream).
        out: list[bytes] = [] if early else [fmt.opening(reqs, writers, early=False)]
        # Replies with reasoning or tool calls are parsed as they stream (one parser per choice).
        parsers = [r.reply.parser() if r.reply is not None else None for r in reqs]
        finished = 0
        continuous = _continuous_usage(reqs[0])
        produced = [0] * len(reqs)
        prompt_once = sum(len(r.prompt_token_ids) for r in reqs if r.sample_index == 0)
        try:
            tagged = len(reqs) > 1  # several prompts: items are (choice index, chunk)
            item = first
            while item is not None:
                i, c = item if tagged else (0, item)
                latencies[i].observe(c)
                used["completion"] += len(c.token_ids)  # so far (the quota's count if it ends early)
                if continuous:
                    produced[i] = c.completion_tokens or produced[i] + len(c.token_ids)
                    mark = len(out)
                w, parser = writers[i], parsers[i]
                if c.extra is not None or c.raw_logprobs is not None:
                    out.append(w.passthrough(c.text, c.extra, c.raw_logprobs))
                elif parser is not None:
                    events = parser.feed(c.text, c.token_ids)
                    if c.finish_reason:
                        events += parser.close()
                    if events or c.logprobs:
                        out.append(w.events(events, c.logprobs))
                elif c.text or c.logprobs:
                    out.append(w.text(c.text, c.logprobs))
                if c.finish_reason:
                    reason = c.finish_reason
                    if parser is not None and parser.calls and reason == "stop":
                        reason = "tool_calls"
                    out.append(w.finish(reason, c))
                    if reqs[i].sample_index == 0:  # a prompt counts once, however many samples
                        usage["prompt"] += c.prompt_tokens
                        usage["cached"] += c.cached_tokens
                    usage["completion"] += c.completion_tokens
                    finished += 1
                if continuous and len(out) > mark:
                    out[mark:] = [with_usage(b"".join(out[mark:]), usage_dict(prompt_once, sum(produced), 0))]
                if finished == len(writers):
                    break
                if out:
                    await resp.write(b"".join(out))
                    out.clear()
                    if direct is not None:  # the head and all before it are out: tokens may go direct now
                        direct.armed = True
                item = await anext(source, None)
            if reqs[0].include_usage:
                out.append(writers[0].usage(usage_dict(usage["prompt"], usage["completion"], usage["cached"])))
            self._count_usage([usage], used)
            self._log_done(reqs[0], [usage], t0, direct)
        except APIError as e:  # failed after the stream started: a final error event, never a hang
            log.warning("event=stream_failed rid=%s status=%d error=%r", reqs[0].id, e.status, e.message)
            out.append(fmt.error(e.message, e.type, e.code or "worker_failed"))
        out.append(fmt.done)
        await resp.write_eof(b"".join(out))
        return resp


def _continuous_usage(req: GenRequest) -> bool:
    """stream_options.continuous_usage_stats: usage so far on every chunk."""
    so = req.body.get("stream_options") or {}
    return bool(so.get("continuous_usage_stats"))


class _SSEResponse(web.StreamResponse):
    """Holds the response head back until the first body write, so both leave in one packet
    (aiohttp's own opt-in for buffered heads; plain StreamResponse sends the head at once)."""

    _send_headers_immediately = False


def _served_headers(req: GenRequest) -> dict[str, str]:
    """Where the request ran (the last attempt): for debugging and for tests."""
    pin = req.served_by
    if pin is None:
        return {}
    return {"X-Splitfire-Decode": pin.decode, "X-Splitfire-Prefill": pin.prefill or "-"}


def best_of(reqs: list[GenRequest], results: list[dict[str, Any]]) -> tuple[list[GenRequest], list[dict[str, Any]]]:
    """Completions' best_of: of each prompt's candidates, the n with the highest log probability
    per token (OpenAI's rule) become its choices. Usage counts every candidate's tokens (they were
    all generated), the prompt once."""
    by_prompt: dict[int, list[tuple[GenRequest, dict[str, Any]]]] = {}
    for req, r in zip(reqs, results, strict=True):
        by_prompt.setdefault(req.prompt_index // req.best_of, []).append((req, r))

    def per_token(c: tuple[GenRequest, dict[str, Any]]) -> float:
        lps = c[1]["logprobs"]
        return sum(lp.logprob for lp in lps) / max(len(lps), 1)

    kept_reqs, kept = [], []
    for p, cands in sorted(by_prompt.items()):
        n = cands[0][0].n
        for j, (req, r) in enumerate(sorted(cands, key=per_token, reverse=True)[:n]):
            kept_reqs.append(dataclasses.replace(req, prompt_index=p * n + j, sample_index=j))
            kept.append({**r, "completion": 0})
    kept[0]["completion"] = sum(r["completion"] for r in results)
    return kept_reqs, kept


async def _merge(iters: list) -> Any:
    """Interleave several choices' chunks into one stream (a list of prompts)."""
    queue: asyncio.Queue = asyncio.Queue()
    sentinel = object()

    async def pump(i: int, it) -> None:
        try:
            async for c in it:
                await queue.put((i, c))
        except BaseException as e:
            await queue.put(e)
        finally:
            await queue.put(sentinel)

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iters)]
    try:
        done = 0
        while done < len(tasks):
            item = await queue.get()
            if item is sentinel:
                done += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


__all__ = ["Chunk", "Router", "load_extra_models", "load_model_info"]
