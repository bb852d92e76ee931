"""Per-key quotas: requests and tokens per minute, streams at once (`tenants.KeyPolicy`).

A request reserves, before it is admitted, one request and its tokens in the current minute's window
(its prompt, plus `max_tokens` when the client set it), and one concurrent stream; when it ends, the
window is charged what it used (prompt + completion) instead of the reservation, and its stream slot
is freed. A request is refused when its reservation would take a counter past its limit. Exceeding any limit is a 429 that
names it, with `Retry-After`: the seconds to the next window, or 1 for concurrency.

A request's counters are checked and taken together, atomically (a Lua script in Redis; one step of
the event loop in memory): a refused request takes nothing, so each limit trips exactly at its value,
and admitting costs one round trip. With Redis (`--redis-url`) the counters are shared by every router
replica (per-key, per-minute keys that expire); if Redis fails, each replica falls back to counting
on its own — logged once per outage, never no limits at all.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from router.api.errors import APIError
from router.tenancy.redis_pipe import PipelinedRedis
from router.tenancy.tenants import Caller, KeyPolicy

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

    def _sweep(self, now: float) -> None:
        if now >= self.next_sweep:
            for k in [k for k, t in self.expiry.items() if t <= now]:
                del self.expiry[k]
                self.counts.pop(k, None)
            self.next_sweep = now + 1.0

    async def take(self, wants: list[_Want]) -> int:
        now = time.monotonic()
        self._sweep(now)
        for i, w in enumerate(wants):
            if self.counts.get(w.key, 0) + w.by > w.limit:
                return i
        for w in wants:
            self.counts[w.key] = self.counts.get(w.key, 0) + w.by
            if w.ttl < 0 or (w.ttl > 0 and w.key not in self.expiry):
                self.expiry[w.key] = now + abs(w.ttl)
        return -1

    async def add(self, changes: list[tuple[str, int]]) -> None:
        for key, by in changes:
            if key in self.counts:  # an expired window is not charged again
                self.counts[key] += by


# KEYS: the counters; ARGV: for each, (by, limit, ttl: > 0 expires that long after it was created, < 0
# that long after it was last taken, 0 never). Returns the 1-based index of the first counter
# that would pass its limit (taking nothing), or 0 after taking them all.
_TAKE = """
for i = 1, #KEYS do
  local v = tonumber(redis.call('GET', KEYS[i]) or '0')
  if v + tonumber(ARGV[3 * i - 2]) > tonumber(ARGV[3 * i - 1]) then return i end
end
for i = 1, #KEYS do
  redis.call('INCRBY', KEYS[i], ARGV[3 * i - 2])
  local ttl = tonumber(ARGV[3 * i])
  if ttl < 0 then redis.call('EXPIRE', KEYS[i], -ttl)
  elseif ttl > 0 and redis.call('TTL', KEYS[i]) < 0 then redis.call('EXPIRE', KEYS[i], ttl) end
end
return 0
"""

# KEYS: the counters; ARGV: the change of each. A counter that expired is not created again.
_ADD = """
for i = 1, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then redis.call('INCRBY', KEYS[i], ARGV[i]) end
end
return 0
"""


class RedisCounters:
    """Counters in Redis through redis-py: the reference for `PipelinedCounters`."""

    def __init__(self, client: Any):
        self._take = client.register_script(_TAKE)
        self._add = client.register_script(_ADD)

    async def take(self, wants: list[_Want]) -> int:
        args: list[int] = []
        for w in wants:
            args += [w.by, w.limit, w.ttl]
        return int(await self._take(keys=[PREFIX + w.key for w in wants], args=args)) - 1

    async def add(self, changes: list[tuple[str, int]]) -> None:
        await self._add(keys=[PREFIX + k for k, _ in changes], args=[by for _, by in changes])


class PipelinedCounters:
    """Counters in Redis through `redis_pipe.PipelinedRedis` (one connection, calls pipelined): the
    same scripts as `RedisCounters`, at a fraction of the router's CPU."""

    def __init__(self, client: PipelinedRedis):
        self.client = client
        self._take = client.script(_TAKE)
        self._add = client.script(_ADD)

    async def take(self, wants: list[_Want]) -> int:
        args: list[int | str] = []
        for w in wants:
            args += [w.by, w.limit, w.ttl]
        return int(await self.client.evalsha(self._take, [PREFIX + w.key for w in wants], args)) - 1

    async def add(self, changes: list[tuple[str, int]]) -> None:
        """Sent without waiting for the reply (the request has ended; nothing depends on it): a
        failure is logged, and a script Redis has forgotten is loaded and run again."""
        keys, args = [PREFIX + k for k, _ in changes], [by for _, by in changes]
        fut = self.client.send("EVALSHA", self._add, len(keys), *keys, *args)
        if fut is None:
            raise ConnectionError("no connection to Redis")

        def done(f: asyncio.Future[Any]) -> None:
            e = None if f.cancelled() else f.exception()
            if e is None:
                return
            if str(e).startswith("NOSCRIPT"):
                asyncio.ensure_future(self.client.evalsha(self._add, keys, list(args))).add_done_callback(done)
            else:
                log.error("event=quota_release_failed error=%r (the counters expire in Redis)", e)

        fut.add_done_callback(done)


class Counters(Protocol):
    async def take(self, wants: list[_Want]) -> int: ...

    async def add(self, changes: list[tuple[str, int]]) -> None: ...


class _Want(NamedTuple):
    key: str
    by: int
    limit: int
    ttl: int  # seconds after the counter was created (> 0) or last taken (< 0); 0 = never
    name: str  # the limit, as the 429 names it


def _refusal(name: str, p: KeyPolicy, tokens: int, retry: int) -> APIError:
    if name == "requests_per_minute":
        return rate_limited(name, f"rate limit of {p.requests_per_minute} requests per minute reached", retry)
    if name == "tokens_per_minute":
        return rate_limited(name, f"rate limit of {p.tokens_per_minute} tokens per minute reached (this request needs "
                                  f"{tokens}: prompt + max_tokens)", retry)
    return rate_limited(name, f"limit of {p.max_concurrent} concurrent requests reached", 1)


class Quotas:
    def __init__(self, shared: Counters | None = None):
        """`shared`: counters every router replica sees (Redis); None: this replica's alone."""
        self.shared = shared
        self.local = _Memory()
        self.degraded = False  # Redis failed: counting on this replica until it answers again

    def _failed(self, e: Exception) -> None:
        if not self.degraded:
            log.error("event=quota_redis_unavailable error=%r (limits now counted per router replica)", e)
            self.degraded = True

    async def admit(self, caller: Caller, prompt_tokens: int, max_tokens: int) -> Reservation | None:
        """Reserve the request against its key's limits, or raise a 429 naming the one it exceeds.
        `max_tokens`: the completion budget the client set (0 when it set none: the completion is
        counted when the request ends)."""
        p = caller.policy
        if not p.limited:
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
        wants: list[_Want] = []
        if p.requests_per_minute is not None:
            wants.append(_Want(f"rpm:{k}:{window}", 1, p.requests_per_minute, 2 * WINDOW_S, "requests_per_minute"))
        if p.tokens_per_minute is not None:
            wants.append(_Want(f"tpm:{k}:{window}", tokens, p.tokens_per_minute, 2 * WINDOW_S, "tokens_per_minute"))
        if p.max_concurrent is not None:
            # Expires an hour after its last use: a replica that dies holding streams does not hold
            # them for ever.
            wants.append(_Want(f"streams:{k}", 1, p.max_concurrent, -3600, "max_concurrent"))
        shared = False
        if self.shared is not None:
            try:
                refused = await self.shared.take(wants)
                shared = True
            except Exception as e:  # any Redis failure: count here, say so once per outage
                self._failed(e)
            else:
                if self.degraded:
                    log.info("event=quota_redis_back (limits shared across router replicas again)")
                    self.degraded = False
        if not shared:
            refused = await self.local.take(wants)
        if refused >= 0:
            raise _refusal(wants[refused].name, p, tokens, retry)
        return Reservation(caller, window, tokens, p.max_concurrent is not None, shared)

    async def release(self, r: Reservation | None, used_tokens: int) -> None:
        """The request ended having used `used_tokens` (prompt + completion): the minute it was
        reserved in is charged that instead of the reservation, and its stream slot is freed."""
        if r is None:
            return
        k = r.caller.key_id
        changes: list[tuple[str, int]] = []
        if r.stream:
            changes.append((f"streams:{k}", -1))
        if r.caller.policy.tokens_per_minute is not None and used_tokens != r.tokens:
            changes.append((f"tpm:{k}:{r.window}", used_tokens - r.tokens))
        if not changes:
            return
        if r.shared and self.shared is not None:
            try:
                await self.shared.add(changes)
                return
            except Exception as e:  # taken in Redis, which went away: its counters expire there
                self._failed(e)
                return
        await self.local.add(changes)
