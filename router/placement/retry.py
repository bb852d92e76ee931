"""Retry and failover: which errors move a request to another endpoint, how often, how soon,
and what the client is told when it cannot move."""

from __future__ import annotations

import asyncio
import logging

from common.tokenizer import Tokenizer
from router.api.chunks import WorkerError
from router.api.errors import APIError
from router.core.config import RouterConfig
from router.core.metrics import RouterMetrics
from router.placement.resume import Progress

log = logging.getLogger("splitfire.router")


def surfaced(e: WorkerError, message: str) -> APIError:
    """The client's error for a worker failure it cannot be moved past. A worker with no room (429 from
    it) is the fleet's problem, not the caller's: 503 `no_capacity`, never a 429 that sends the client
    into its rate-limit backoff."""
    if e.status == 429:
        return APIError(503, message, type_="service_unavailable", code="no_capacity", headers={"Retry-After": "1"})
    return APIError(e.status, message, type_="invalid_request_error" if e.status == 400 else "upstream_error",
                    code=None if e.status == 400 else "worker_failed",
                    headers={"Retry-After": "1"} if e.status == 503 else None)


def counts_against_endpoint(e: WorkerError) -> bool:
    """Server-side failures count toward an endpoint's breaker; a refused request (4xx: bad input,
    or 429: busy) says nothing about the endpoint's health."""
    return e.retryable and e.status >= 500


class Retry:
    def __init__(self, cfg: RouterConfig, metrics: RouterMetrics, request_id: str):
        self.cfg = cfg
        self.metrics = metrics
        self.request_id = request_id
        self.attempts = 0  # failed so far
        self.exclude: set[str] = set()  # endpoints this request will not go back to
        self.last_error: WorkerError | None = None

    def nowhere_left(self, e: APIError) -> APIError:
        """Placement found no endpoint: after a failure, the client learns what actually went wrong."""
        if self.last_error is None:
            return e
        return surfaced(self.last_error, f"request failed after {self.attempts} attempt(s), no other endpoint to "
                        f"try: {self.last_error}")

    async def after(self, e: WorkerError, token_level: bool, progress: Progress, tokenizer: Tokenizer | None) -> None:
        """Decide on a failed attempt: raise the client's error, or wait the backoff and return (retry)."""
        self.last_error = e
        self.attempts += 1
        if e.failed:
            self.exclude.add(e.failed)
        if not e.retryable:
            raise surfaced(e, str(e))
        if self.attempts > self.cfg.max_retries or not (token_level or not progress.delivered):
            raise surfaced(e, f"request failed after {self.attempts} attempt(s): {e}")
        kind = "failover" if (progress.generated or progress.sent_text) else "retry"
        self.metrics.retries.labels(kind=kind).inc()
        log.warning("event=%s rid=%s attempt=%d failed=%s generated=%d error=%r", kind, self.request_id,
                    self.attempts, e.failed, len(progress.generated), str(e))
        if kind == "failover" and tokenizer is not None:
            progress.rewind(tokenizer)
        await asyncio.sleep(self.cfg.retry_backoff_s * 2 ** (self.attempts - 1))
