"""Worker self-registration: a heartbeat into Redis that routers read to find this worker."""

from __future__ import annotations

import asyncio
import logging
import time

from worker.worker_service import WorkerContext

log = logging.getLogger("splitfire.worker")

KEY = "splitfire:workers:{role}"  # sorted set of host:port scored by expiry; read by router/discovery.py
INTERVAL_S = 2.0
TTL_S = 6.0


async def heartbeat_loop(ctx: WorkerContext) -> None:
    import redis.asyncio as aioredis

    cfg = ctx.config
    key = KEY.format(role=cfg.role)
    client = aioredis.from_url(cfg.redis_url)
    try:
        while True:
            try:
                if not ctx.draining:
                    await client.zadd(key, {cfg.advertise: time.time() + TTL_S})
                else:
                    await client.zrem(key, cfg.advertise)
            except Exception as e:  # Redis down: keep serving, keep trying
                log.warning("event=heartbeat_failed redis=%s error=%r", cfg.redis_url, e)
            await asyncio.sleep(INTERVAL_S)
    except asyncio.CancelledError:
        try:
            await client.zrem(key, cfg.advertise)
        finally:
            await client.aclose()
        raise
