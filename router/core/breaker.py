"""Per-endpoint circuit breaker: closed -> open -> half-open -> closed.

Requests and health checks both report here; nothing else changes an endpoint's health.

- closed: in rotation. Opens when the recent error rate reaches `error_rate` (over the last
  `window` outcomes, once `min_requests` are in), after `consecutive` failures in a row, or
  when `unhealthy_after` health checks fail in a row. One failure never ejects: a request
  that fails once is retried elsewhere, the endpoint stays.
- open: out of rotation for `open_s`, doubled on each failed probe (up to `max_open_s`).
  A passing health check ends the wait at once when health checks failed while it was open (a
  restarted worker comes back as soon as it answers), not when only requests failed (the
  process answers but its requests fail).
- half-open: in rotation for one probe request at a time; its success closes the breaker,
  its failure opens it again.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


@dataclass(frozen=True)
class BreakerConfig:
    window: int = 20
    min_requests: int = 6
    error_rate: float = 0.5
    consecutive: int = 3
    unhealthy_after: int = 2
    open_s: float = 2.0
    max_open_s: float = 30.0


@dataclass
class CircuitBreaker:
    cfg: BreakerConfig = field(default_factory=BreakerConfig)
    state: str = CLOSED
    reason: str = ""  # why it last opened: "requests" or "health"
    opened_at: float = 0.0
    open_for: float = 0.0
    probing: bool = False  # half-open: a probe request is in flight
    consecutive_failures: int = 0
    failed_checks: int = 0
    outcomes: deque[bool] = field(default_factory=deque)  # True = failure, newest last

    def available(self, now: float | None = None) -> bool:
        """Whether a new request may go here (an open breaker whose wait is over turns half-open)."""
        if self.state == CLOSED:
            return True
        if self.state == OPEN:
            if (time.monotonic() if now is None else now) - self.opened_at < self.open_for:
                return False
            self.state = HALF_OPEN
        return not self.probing

    def on_attempt(self) -> bool:
        """Returns True when this attempt is the half-open probe (it must release the slot if it
        ends without a verdict)."""
        if self.state == HALF_OPEN and not self.probing:
            self.probing = True
            return True
        return False

    def on_success(self) -> bool:
        """Returns True when this closed the breaker."""
        self.consecutive_failures = 0
        self.failed_checks = 0  # it serves: checks failing before this (a channel still reconnecting) are stale
        self._record(False)
        if self.state == CLOSED:
            return False
        self.state, self.probing, self.open_for = CLOSED, False, 0.0
        self.outcomes.clear()
        return True

    def on_failure(self) -> bool:
        """Returns True when this opened the breaker."""
        self.consecutive_failures += 1
        self._record(True)
        if self.state == HALF_OPEN:
            return self._open("requests", backoff=True)
        if self.state == OPEN:
            return False
        n = len(self.outcomes)
        rate_tripped = n >= self.cfg.min_requests and sum(self.outcomes) / n >= self.cfg.error_rate
        if rate_tripped or self.consecutive_failures >= self.cfg.consecutive:
            return self._open("requests")
        return False

    def on_check(self, ok: bool) -> str | None:
        """A health check's result; returns "opened" / "half_open" when it changed the state."""
        if not ok:
            self.failed_checks += 1
            if self.failed_checks >= self.cfg.unhealthy_after:
                if self.state != OPEN:
                    self._open("health")
                    return "opened"
                self.reason = "health"  # down, not just failing: its first passing check half-opens it
            return None
        self.failed_checks = 0
        if self.state == OPEN and self.reason == "health":
            self.state, self.probing = HALF_OPEN, False
            return "half_open"
        return None

    def _open(self, reason: str, backoff: bool = False) -> bool:
        base = self.open_for * 2 if backoff and self.open_for else self.cfg.open_s
        self.state, self.reason, self.probing = OPEN, reason, False
        self.opened_at, self.open_for = time.monotonic(), min(base, self.cfg.max_open_s)
        return True

    def _record(self, failed: bool) -> None:
        self.outcomes.append(failed)
        if len(self.outcomes) > self.cfg.window:
            self.outcomes.popleft()

    def release_probe(self) -> None:
        """A probe request ended without a verdict (the client left): let another probe go."""
        self.probing = False
