"""Admission control: a bounded number of requests run, a bounded number wait; the rest get 429.

When every slot is taken, waiting requests queue per tenant, and a freed slot goes to the tenant
with the smallest virtual time — weighted fair queuing: each grant advances its tenant's time by
1 / weight, and a tenant that starts waiting begins at the current virtual time, so time spent idle
earns no credit. A tenant under its share is never queued behind another's backlog; two backlogged
tenants of weights 2 and 1 get slots 2:1.
"""

from __future__ import annotations

import asyncio
from collections import deque

from router.api.errors import overloaded
from router.core.metrics import RouterMetrics


class Admission:
    def __init__(self, max_concurrency: int, max_queue: int, queue_timeout_s: float, metrics: RouterMetrics):
        self.capacity = max_concurrency
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.waiting = 0
        self.running = 0
        self.metrics = metrics
        self.queues: dict[str, deque[tuple[asyncio.Future[None], float]]] = {}
        self.vtime: dict[str, float] = {}
        self.now = 0.0  # the virtual time of the latest grant

    def slot(self, tenant: str = "default", weight: float = 1.0) -> _Slot:
        return _Slot(self, tenant, weight)

    def _charge(self, tenant: str, weight: float) -> None:
        start = max(self.vtime.get(tenant, 0.0), self.now)
        self.now = start
        self.vtime[tenant] = start + 1.0 / weight
        self.running += 1
        self.metrics.running.set(self.running)

    def _grant(self) -> None:
        """Free slots to the waiting tenants with the smallest virtual times."""
        while self.running < self.capacity and self.waiting:
            # The earliest virtual start; on a tie, the tenant with fewer waiting (a newcomer).
            tenant = min(self.queues, key=lambda t: (max(self.vtime.get(t, 0.0), self.now), len(self.queues[t])))
            fut, weight = self.queues[tenant].popleft()
            self.waiting -= 1
            if not self.queues[tenant]:
                del self.queues[tenant]
            if fut.done():  # its waiter was cancelled, and has not run since to withdraw
                continue
            self._charge(tenant, weight)
            fut.set_result(None)
        self.metrics.queue.set(self.waiting)

    def _withdraw(self, tenant: str, entry: tuple[asyncio.Future[None], float]) -> None:
        q = self.queues.get(tenant)
        if q is not None and entry in q:
            q.remove(entry)
            self.waiting -= 1
            if not q:
                del self.queues[tenant]
            self.metrics.queue.set(self.waiting)

    def _release(self) -> None:
        self.running -= 1
        self.metrics.running.set(self.running)
        self._grant()


class _Slot:
    """`async with admission.slot(tenant, weight):` (a plain class: this runs once per request)."""

    __slots__ = ("adm", "tenant", "weight")

    def __init__(self, adm: Admission, tenant: str, weight: float):
        self.adm, self.tenant, self.weight = adm, tenant, weight

    async def __aenter__(self) -> None:
        a = self.adm
        if a.running < a.capacity and not a.waiting:
            a._charge(self.tenant, self.weight)  # a free slot and nobody ahead: at once
            return
        if a.waiting >= a.max_queue:
            raise overloaded(f"server is at capacity ({a.running} running, {a.waiting} queued); retry shortly")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        entry = (fut, self.weight)
        a.queues.setdefault(self.tenant, deque()).append(entry)
        a.waiting += 1
        a.metrics.queue.set(a.waiting)
        # A timer instead of asyncio.wait_for + shield: this runs for every queued request.
        expiry = loop.call_later(a.queue_timeout_s, self._expire, fut, entry)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                a._release()  # granted, but the client went away: hand the slot on
            else:
                a._withdraw(self.tenant, entry)
            raise
        finally:
            expiry.cancel()

    def _expire(self, fut: asyncio.Future[None], entry: tuple[asyncio.Future[None], float]) -> None:
        if not fut.done():
            self.adm._withdraw(self.tenant, entry)
            fut.set_exception(overloaded(f"no capacity within {self.adm.queue_timeout_s:.0f}s; retry shortly"))

    async def __aexit__(self, *exc: object) -> None:
        self.adm._release()
