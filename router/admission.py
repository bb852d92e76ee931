"""Admission control: a bounded number of requests run, a bounded number wait; the rest get 429."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

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

    @asynccontextmanager
    async def slot(self):
        if self._slots.locked() and self.waiting >= self.max_queue:
            raise overloaded(f"server is at capacity ({self.running} running, {self.waiting} queued); retry shortly")
        self.waiting += 1
        self.metrics.queue.set(self.waiting)
        try:
            await asyncio.wait_for(self._slots.acquire(), self.queue_timeout_s)
        except TimeoutError:
            raise overloaded(f"no capacity within {self.queue_timeout_s:.0f}s; retry shortly") from None
        finally:
            self.waiting -= 1
            self.metrics.queue.set(self.waiting)
        self.running += 1
        self.metrics.running.set(self.running)
        try:
            yield
        finally:
            self.running -= 1
            self.metrics.running.set(self.running)
            self._slots.release()
