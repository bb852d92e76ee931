"""Admission control: a bounded number of requests run, a bounded number wait; the rest get 429."""

from __future__ import annotations

import asyncio

from router.errors import overloaded
from router.metrics import RouterMetrics


class Admission:
    def __init__(self, max_concurrency: int, max_queue: int, queue_timeout_s: float, metrics: RouterMetrics):
        self._slots = asyncio.Semaphore(max_concurrency)
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.waiting = 0
        self.running = 0
        self.metrics = metrics

    def slot(self) -> _Slot:
        return _Slot(self)


class _Slot:
    """`async with admission.slot():` (a plain class: this runs once per request on the hot path)."""

    __slots__ = ("adm",)

    def __init__(self, adm: Admission):
        self.adm = adm

    async def __aenter__(self) -> None:
        a = self.adm
        if a._slots.locked():
            if a.waiting >= a.max_queue:
                raise overloaded(f"server is at capacity ({a.running} running, {a.waiting} queued); retry shortly")
            a.waiting += 1
            a.metrics.queue.set(a.waiting)
            try:
                await asyncio.wait_for(a._slots.acquire(), a.queue_timeout_s)
            except TimeoutError:
                raise overloaded(f"no capacity within {a.queue_timeout_s:.0f}s; retry shortly") from None
            finally:
                a.waiting -= 1
                a.metrics.queue.set(a.waiting)
        else:
            await a._slots.acquire()  # a free slot: returns at once
        a.running += 1
        a.metrics.running.set(a.running)

    async def __aexit__(self, *exc: object) -> None:
        a = self.adm
        a.running -= 1
        a.metrics.running.set(a.running)
        a._slots.release()
