"""LoRA adapters across the fleet (vLLM's routes): every worker of the adapter's base model loads it from
its `lora_path` (under the workers' --lora-root), all or none, and every worker holding it unloads it; the
names become model names through `ModelPools.refresh_adapters`. With --api-keys, admin keys only."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from router.api.errors import APIError, bad_request, not_found, unavailable
from router.app.body import read_json
from router.backends.worker_client import WorkerClient
from router.core.config import RouterConfig
from router.core.endpoints import EndpointRegistry
from router.core.model_pools import ModelPool, ModelPools
from router.tenancy.tenants import Tenants

log = logging.getLogger("splitfire.router")


class AdapterAdmin:
    def __init__(self, cfg: RouterConfig, pools: ModelPools, registry: EndpointRegistry, workers: WorkerClient,
                 tenants: Tenants):
        self.cfg = cfg
        self.pools = pools
        self.registry = registry
        self.workers = workers
        self.tenants = tenants

    def _adapter_base(self, body: Any) -> ModelPool | None:
        """With several models, the load route's `model` names the adapter's base model (its workers
        load it); with one it may be left out."""
        model = body.pop("model", None) if isinstance(body, dict) else None
        if model is None:
            if self.pools.multi:
                raise bad_request(f"'model' is required: this router serves several models; name the adapter's base "
                                  f"model, one of {sorted(self.pools.pools)}", param="model")
            return None
        if not isinstance(model, str) or model not in self.pools.pools:
            raise bad_request(f"'model' must name a served base model, one of {sorted(self.pools.pools)}", param="model")
        return self.pools.pools[model]

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

    async def load(self, request: web.Request) -> web.Response:
        """vLLM's route: every worker (prefill, decode, colocated) loads the adapter from `lora_path`, which
        must lie under the workers' --lora-root; with --api-keys only admin keys may. All or none: a
        worker refusing it (a 400 naming why) unloads it from those that took it."""
        self.tenants.admin(request)
        body = await read_json(request)
        base = self._adapter_base(body)
        name, path = self._adapter_body(body, ("lora_name", "lora_path"))
        if name in self.pools.model_names:
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
        self.pools.refresh_adapters(self.registry.all())
        log.info("event=lora_loaded name=%s path=%s endpoints=%d", name, path, len(eps))
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        """Every worker holding it stops taking requests for it; requests running under it finish."""
        self.tenants.admin(request)
        (name,) = self._adapter_body(await read_json(request), ("lora_name",))
        if name not in self.pools.adapter_names:
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
        self.pools.refresh_adapters(self.registry.all())
        log.info("event=lora_unloaded name=%s endpoints=%d", name, len(eps))
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
