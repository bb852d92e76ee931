"""Per-key quotas: requests and tokens per minute, streams at once (`tenants.KeyPolicy`).

A request reserves, before it is admitted, one request and its tokens in the current minute's window
(its prompt, plus `max_tokens` when the client set it), and one concurrent stream; when it ends, the
window is charged what it used (prompt + completion) instead of the reservation, and its stream slot
is freed. A request is refused when its reservation would take a counter past its limit. Exceeding any limit is a 429 that
names it, with `Retry-After`: the seconds to the next window, or 1 for concurrency.

With Redis (`--redis-url`) the counters are shared by every router replica (`INCRBY` on per-key,
per-minute keys that expire); if Redis fails, each replica falls back to counting on its own — logged
once per outage, never no limits at all.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from router.errors import APIError
from router.tenants import Caller

log = logging.getLogger("splitfire.router")

WINDOW_S = 60
PREFIX = "splitfire:quota:"


def rate_limited(limit: str, message: str, retry_after: int) -> APIError:
    return APIError(429, message, type_="rate_limit_error", code="rate_limit_exceeded", param=limit,
                     headers={"Retry-After": str(max(retry_after, 1))})


@dataclass
class Reservation:
    caller: Caller
    window: int  # the minute the tokens were reserved in
    tokens: int  # reserved: prompt + max_tokens
    stream: bool  # holds a concurrent-stream slot
    shared: bool  # counted in Redis (else on this replica: released where it was taken)


class _Memory:
    """Counters of this replica alone (no Redis, or Redis unreachable); expired ones are swept as the
    clock passes their expiry, so per-minute keys do not pile up."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.expiry: dict[str, float] = {}
        self.next_sweep = 0.0

    async def incr(self, key: str, by: int, ttl: int) -> int:
        now = time.monotonic()
        if now >= self.next_sweep:
            for k in [k for k, t in self.expiry.items() if t <= now]:
                del self.expiry[k]
                self.counts.pop(k, None)
            self.next_sweep = now + 1.0
        self.counts[key] = self.counts.get(key, 0) + by
        if ttl and key not in self.expiry:
            self.expiry[key] = now + ttl
        return self.counts[key]


class _Redis:
    def __init__(self, client: Any):
        self.client = client

    async def incr(self, key: str, by: int, ttl: int) -> int:
        pipe = self.client.pipeline(transaction=True)
        pipe.incrby(key, by)
        if ttl:
            pipe.expire(key, ttl, nx=True)
        value, *_ = await pipe.execute()
        return int(value)


class Quotas:
    def __init__(self, redis: Any = None):
        self.shared = _Redis(redis) if redis is not None else None
        self.local = _Memory()
        self.degraded = False  # Redis failed: counting on this replica until it answers again

    async def _incr(self, key: str, by: int, ttl: int, shared: bool) -> tuple[int, bool]:
        """Add to a counter: (its value, whether Redis held it)."""
        if shared and self.shared is not None:
            try:
                value = await self.shared.incr(PREFIX + key, by, ttl)
            except Exception as e:  # any Redis failure: count here, say so once per outage
                if not self.degraded:
                    log.error("event=quota_redis_unavailable error=%r (limits now counted per router replica)", e)
                    self.degraded = True
            else:
                if self.degraded:
                    log.info("event=quota_redis_back (limits shared across router replicas again)")
                    self.degraded = False
                return value, True
        return await self.local.incr(key, by, ttl), False

    async def admit(self, caller: Caller, prompt_tokens: int, max_tokens: int) -> Reservation | None:
        """Reserve the request against its key's limits, or raise a 429 naming the one it exceeds.
        `max_tokens`: the completion budget the client set (0 when it set none: the completion is
        counted when the request ends)."""
        p = caller.policy
        if p.max_concurrent is None and p.requests_per_minute is None and p.tokens_per_minute is None:
            return None
        now = time.time()
        window = int(now // WINDOW_S)
        retry = int((window + 1) * WINDOW_S - now) + 1
        k = caller.key_id
        tokens = prompt_tokens + max_tokens
        if p.tokens_per_minute is not None and tokens > p.tokens_per_minute:
            raise rate_limited("tokens_per_minute", f"this request needs {tokens} tokens (prompt + max_tokens), more "
                                                    f"than the key's limit of {p.tokens_per_minute} per minute",
                               retry)
        shared = self.shared is not None
        taken: list[tuple[str, int]] = []  # undone if a later limit refuses

        async def take(key: str, by: int, limit: int, ttl: int, name: str, message: str, wait: int) -> None:
            nonlocal shared
            value, held = await self._incr(key, by, ttl, shared)
            if shared and not held:  # Redis went away between two counters: undo there later, count here
                shared = False
            taken.append((key, by))
            if value > limit:
                for key_, by_ in taken:
                    await self._incr(key_, -by_, 0, shared)
                raise rate_limited(name, message, wait)

        if p.requests_per_minute is not None:
            await take(f"rpm:{k}:{window}", 1, p.requests_per_minute, 2 * WINDOW_S, "requests_per_minute",
                       f"rate limit of {p.requests_per_minute} requests per minute reached", retry)
        if p.tokens_per_minute is not None:
            await take(f"tpm:{k}:{window}", tokens, p.tokens_per_minute, 2 * WINDOW_S, "tokens_per_minute",
                       f"rate limit of {p.tokens_per_minute} tokens per minute reached (this request needs "
                       f"{tokens}: prompt + max_tokens)", retry)
        if p.max_concurrent is not None:
            await take(f"streams:{k}", 1, p.max_concurrent, 0, "max_concurrent",
                       f"limit of {p.max_concurrent} concurrent requests reached", 1)
        return Reservation(caller, window, tokens, p.max_concurrent is not None, shared)

    async def release(self, r: Reservation | None, used_tokens: int) -> None:
        """The request ended having used `used_tokens` (prompt + completion): the minute it was
        reserved in is charged that instead of the reservation, and its stream slot is freed."""
        if r is None:
            return
        k = r.caller.key_id
        if r.stream:
            await self._incr(f"streams:{k}", -1, 0, r.shared)
        if r.caller.policy.tokens_per_minute is not None and used_tokens != r.tokens:
            await self._incr(f"tpm:{k}:{r.window}", used_tokens - r.tokens, 2 * WINDOW_S, r.shared)
