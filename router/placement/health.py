"""Active health checks feeding the endpoints' circuit breakers, load reconciliation from the
workers' Stats, and what the fleet reports about itself (KV block size, served model names)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from router.backends.backend import Backends, Probe
from router.core.config import RouterConfig
from router.core.endpoints import Endpoint, EndpointRegistry

log = logging.getLogger("splitfire.router")


class HealthChecker:
    def __init__(self, cfg: RouterConfig, registry: EndpointRegistry, backends: Backends,
                 learned_models: set[str] | None = None, on_adapters: Callable[[], None] | None = None):
        self.cfg = cfg
        self.registry = registry
        self.backends = backends
        # Served model names learned from upstreams' /v1/models (None: the names are configured).
        self.learned_models = learned_models
        self.on_adapters = on_adapters  # a worker's resident LoRA adapters changed

    async def check(self, ep: Endpoint) -> bool:
        try:
            probe = await self.backends.of(ep).probe(ep, self.cfg.health_timeout_s)
        except Exception as e:  # any failure to answer is a failed check
            log.debug("event=health_check_failed address=%s error=%r", ep.address, e)
            probe = Probe(False)
        ok = probe.ok
        if ok and probe.block_size:
            ok = self.registry.admit_block_size(ep, probe.block_size)
            if (probe.stream_port, probe.stream_mux) != (ep.stream_port, ep.stream_mux):
                log.info("event=endpoint_stream role=%s address=%s http_port=%d mux=%s", ep.role, ep.address,
                         probe.stream_port, probe.stream_mux)
            ep.block_size, ep.max_model_len, ep.stream_port = probe.block_size, probe.max_model_len, probe.stream_port
            ep.stream_mux = probe.stream_mux
            if probe.model != ep.served_model:
                log.info("event=endpoint_model role=%s address=%s model=%s", ep.role, ep.address, probe.model)
                ep.served_model = probe.model
            if (set(probe.hosted), set(probe.resident)) != (ep.hosted, ep.resident):
                log.info("event=endpoint_hosted_models role=%s address=%s models=%s resident=%s", ep.role, ep.address,
                         ",".join(probe.hosted) or "-", ",".join(probe.resident) or "-")
                ep.hosted, ep.resident = set(probe.hosted), set(probe.resident)
            bases = dict(zip(probe.adapters, probe.adapter_models, strict=True)) if probe.adapter_models else {}
            if set(probe.adapters) != ep.adapters or bases != ep.adapter_models:
                log.info("event=endpoint_adapters role=%s address=%s adapters=%s", ep.role, ep.address,
                         ",".join(f"{a}:{bases[a]}" if a in bases else a for a in sorted(probe.adapters)) or "-")
                ep.adapters, ep.adapter_models = set(probe.adapters), bases
                if self.on_adapters is not None:
                    self.on_adapters()
        if ok and probe.load is not None:
            ep.reconcile(*probe.load)
        elif not ok:
            ep.reconcile(0, 0, 0)  # what it reported last is stale: only our own estimates stand
        if ok and probe.models:
            self._learn_models(ep, probe.models)
        self.registry.on_check(ep, ok)
        return ok

    def _learn_models(self, ep: Endpoint, models: list[str]) -> None:
        if set(models) != ep.models:
            log.info("event=endpoint_models address=%s models=%s", ep.address, ",".join(models))
            ep.models = set(models)
        if self.learned_models is not None:  # the union of what the upstreams list now
            now = set().union(*(e.models for e in self.registry.all() if e.models))
            self.learned_models.intersection_update(now)
            self.learned_models.update(now)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(ep) for ep in self.registry.all()))

    async def run(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.cfg.health_interval_s)
