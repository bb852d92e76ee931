"""Admission control: a bounded number of requests run, a bounded number wait; the rest are refused.

Priority bands (`priority`, vLLM's field: an integer, lower is more important, 0 by default): a freed
slot always goes to the most important band with anyone waiting. Inside a band, waiting requests
queue per tenant and the slot goes to the tenant with the smallest virtual time — weighted fair
queuing: each grant advances its tenant's time by 1 / weight, and a tenant that starts waiting begins
at the current virtual time, so time spent idle earns no credit. A tenant under its share is never
queued behind another's backlog; two backlogged tenants of weights 2 and 1 get slots 2:1.

When the queue is full, a request of a more important band than the least important one waiting
takes the place of that band's newest waiter, which is shed. The answers say whose problem it is:

- 429 `priority_shed` (+ Retry-After): the request lost its place, or never got one, to more important
  work — its band is shed; the fleet is serving others.
- 503 `no_capacity` (+ Retry-After): nothing more important holds the fleet; it is simply full
  (the queue, or no slot within the queue timeout). Retrying elsewhere or later is the right move.

A caller's own quota (tenancy/quotas.py) is the other 429 (`rate_limit_exceeded`).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque

from router.api.errors import APIError, no_capacity, priority_shed
from router.core.metrics import RouterMetrics

# A waiter: its future, its tenant's weight, its arrival number (the newest is shed first).
_Entry = tuple[asyncio.Future[None], float, int]


class Admission:
    def __init__(self, max_concurrency: int, max_queue: int, queue_timeout_s: float, metrics: RouterMetrics):
        self.capacity = max_concurrency
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.waiting = 0
        self.running = 0
        self.metrics = metrics
        self.queues: dict[int, dict[str, deque[_Entry]]] = {}  # band -> tenant -> waiters, oldest first
        self.running_by_band: dict[int, int] = {}
        self.vtime: dict[str, float] = {}
        self.now = 0.0  # the virtual time of the latest grant
        self._arrivals = itertools.count()

    def slot(self, tenant: str = "default", weight: float = 1.0, priority: int = 0) -> _Slot:
        return _Slot(self, tenant, weight, priority)

    def outranked(self, priority: int) -> bool:
        """Whether more important work than `priority` is running or waiting."""
        return any(b < priority for b in self.running_by_band) or any(b < priority for b in self.queues)

    def refusal(self, priority: int, why: str) -> APIError:
        """The answer to a request that gets no slot: shed (429) when more important work holds the
        fleet, else no capacity (503)."""
        if self.outranked(priority):
            self.metrics.admission_refused.labels(reason="priority_shed").inc()
            return priority_shed(f"{why}; requests of higher priority than {priority} hold the capacity")
        self.metrics.admission_refused.labels(reason="no_capacity").inc()
        return no_capacity(f"{why}; retry shortly")

    def _charge(self, tenant: str, weight: float, band: int) -> None:
        start = max(self.vtime.get(tenant, 0.0), self.now)
        self.now = start
        self.vtime[tenant] = start + 1.0 / weight
        self.running += 1
        self.running_by_band[band] = self.running_by_band.get(band, 0) + 1
        self.metrics.running.set(self.running)

    def _grant(self) -> None:
        """Free slots to the most important band's waiting tenants with the smallest virtual times."""
        while self.running < self.capacity and self.waiting:
            band = min(self.queues)
            queues = self.queues[band]
            # The earliest virtual start; on a tie, the tenant with fewer waiting (a newcomer).
            tenant = min(queues, key=lambda t: (max(self.vtime.get(t, 0.0), self.now), len(queues[t])))
            fut, weight, _ = queues[tenant].popleft()
            self._forget(band, tenant)
            if fut.done():  # its waiter was cancelled, and has not run since to withdraw
                continue
            self._charge(tenant, weight, band)
            fut.set_result(None)
        self.metrics.queue.set(self.waiting)

    def _forget(self, band: int, tenant: str) -> None:
        """One waiter of (band, tenant) has left its deque: drop what became empty."""
        self.waiting -= 1
        queues = self.queues[band]
        if not queues[tenant]:
            del queues[tenant]
            if not queues:
                del self.queues[band]

    def _withdraw(self, band: int, tenant: str, entry: _Entry) -> None:
        q = self.queues.get(band, {}).get(tenant)
        if q is not None and entry in q:
            q.remove(entry)
            self._forget(band, tenant)
            self.metrics.queue.set(self.waiting)

    def _shed_for(self, priority: int) -> bool:
        """The queue is full and a request of band `priority` arrives: shed the newest waiter of the
        least important band, if that band is less important than it. Whether one was shed."""
        worst = max(self.queues, default=None)
        if worst is None or worst <= priority:
            return False
        queues = self.queues[worst]
        tenant = max(queues, key=lambda t: queues[t][-1][2])
        fut, _, _ = queues[tenant].pop()
        self._forget(worst, tenant)
        self.metrics.queue.set(self.waiting)
        if not fut.done():
            self.metrics.admission_refused.labels(reason="priority_shed").inc()
            fut.set_exception(priority_shed(f"shed from the queue for a request of priority {priority} (this one "
                                            f"has {worst}); the fleet is serving more important work"))
        return True

    def _release(self, band: int) -> None:
        self.running -= 1
        n = self.running_by_band[band] - 1
        if n:
            self.running_by_band[band] = n
        else:
            del self.running_by_band[band]
        self.metrics.running.set(self.running)
        self._grant()


class _Slot:
    """`async with admission.slot(tenant, weight, priority):` (a plain class: this runs once per request)."""

    __slots__ = ("adm", "band", "tenant", "weight")

    def __init__(self, adm: Admission, tenant: str, weight: float, priority: int):
        self.adm, self.tenant, self.weight, self.band = adm, tenant, weight, priority

    async def __aenter__(self) -> None:
        a = self.adm
        if a.running < a.capacity and not a.waiting:
            a._charge(self.tenant, self.weight, self.band)  # a free slot and nobody ahead: at once
            return
        if a.waiting >= a.max_queue and not a._shed_for(self.band):
            raise a.refusal(self.band, f"server is at capacity ({a.running} running, {a.waiting} queued)")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        entry = (fut, self.weight, next(a._arrivals))
        a.queues.setdefault(self.band, {}).setdefault(self.tenant, deque()).append(entry)
        a.waiting += 1
        a.metrics.queue.set(a.waiting)
        # A timer instead of asyncio.wait_for + shield: this runs for every queued request.
        expiry = loop.call_later(a.queue_timeout_s, self._expire, fut, entry)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                a._release(self.band)  # granted, but the client went away: hand the slot on
            else:
                a._withdraw(self.band, self.tenant, entry)
            raise
        finally:
            expiry.cancel()

    def _expire(self, fut: asyncio.Future[None], entry: _Entry) -> None:
        if not fut.done():
            a = self.adm
            a._withdraw(self.band, self.tenant, entry)
            fut.set_exception(a.refusal(self.band, f"no slot within {a.queue_timeout_s:.0f}s"))

    async def __aexit__(self, *exc: object) -> None:
        self.adm._release(self.band)
