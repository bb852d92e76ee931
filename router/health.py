"""Active health checks with a circuit breaker, and load reconciliation from workers' Stats.

An endpoint that fails `unhealthy_after` checks in a row (or a request, see
`EndpointRegistry.mark_failed`) leaves rotation; the first passing check brings it back.
"""

from __future__ import annotations

import asyncio
import logging

from router.config import RouterConfig
from router.endpoints import Endpoint, EndpointRegistry
from router.openai_upstream import OpenAIUpstreamClient
from router.worker_client import WorkerClient

log = logging.getLogger("splitfire.router")


class HealthChecker:
    def __init__(self, cfg: RouterConfig, registry: EndpointRegistry, workers: WorkerClient,
                 upstreams: OpenAIUpstreamClient):
        self.cfg = cfg
        self.registry = registry
        self.workers = workers
        self.upstreams = upstreams

    async def check(self, ep: Endpoint) -> bool:
        t = self.cfg.health_timeout_s
        try:
            if ep.role == "openai":
                ok = await self.upstreams.health(ep.address, t)
            else:
                h = await self.workers.health(ep.address, t)
                ok = h.status == "serving" and self.registry.admit_block_size(ep, h.block_size)
                ep.block_size, ep.max_model_len = h.block_size, h.max_model_len
        except Exception as e:  # any failure to answer is a failed check
            log.debug("event=health_check_failed address=%s error=%r", ep.address, e)
            ok = False
        if ok and ep.role != "openai":
            # Load reconciliation is best effort: a slow Stats answer is not a sick worker.
            try:
                st = await self.workers.stats(ep.address, t)
                ep.reconcile(st.prompt_tokens_in_flight, st.kv_tokens_held, st.decode_tokens_remaining)
            except Exception as e:
                log.info("event=stats_failed address=%s error=%r", ep.address, e)
        if ok:
            if not ep.healthy:
                log.info("event=endpoint_readmitted role=%s address=%s", ep.role, ep.address)
            ep.healthy, ep.consecutive_failures = True, 0
        else:
            ep.consecutive_failures += 1
            if ep.healthy and ep.consecutive_failures >= self.cfg.unhealthy_after:
                ep.healthy = False
                log.warning("event=endpoint_ejected role=%s address=%s reason=health_check", ep.role, ep.address)
        return ok

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(ep) for ep in self.registry.all()))

    async def run(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.cfg.health_interval_s)
