"""Finding workers that were not listed on the command line: Redis self-registration
(workers heartbeat into a sorted set) and DNS (a Kubernetes headless Service)."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

from router.core.endpoints import EndpointRegistry

log = logging.getLogger("splitfire.router")

REGISTRY_KEY = "splitfire:workers:{role}"  # sorted set: member = host:port, score = expiry (unix s)
ROLE_TO_ENDPOINT = {"prefill": "prefill", "decode": "decode", "both": "colocated"}


async def redis_discovery(redis, registry: EndpointRegistry, interval_s: float = 2.0) -> None:
    while True:
        now = time.time()
        for worker_role, role in ROLE_TO_ENDPOINT.items():
            try:
                members = await redis.zrangebyscore(REGISTRY_KEY.format(role=worker_role), now, "+inf")
            except Exception as e:
                log.warning("event=redis_discovery_failed error=%r", e)
                break
            registry.sync(role, "redis", {m.decode() if isinstance(m, bytes) else m for m in members})
        await asyncio.sleep(interval_s)


async def dns_discovery(specs: list[str], registry: EndpointRegistry, interval_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    while True:
        for spec in specs:
            role, _, target = spec.partition("=")
            host, _, port = target.rpartition(":")
            try:
                infos = await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
                addrs = {f"{info[4][0]}:{port}" for info in infos if info[0] == socket.AF_INET}
            except OSError as e:
                log.warning("event=dns_discovery_failed target=%s error=%r", target, e)
                continue
            registry.sync(role, f"dns:{target}", addrs)
        await asyncio.sleep(interval_s)
