"""The load one start-up time ahead: Holt-Winters' multiplicative method with a daily season.

Why this model: serving load has a trend within the hour (a morning rise, an evening fall) and a shape that
repeats every day (ServeGen's published clients vary 5-10x over a day, and the phase that is prompt-heavy moves
with the hour). Holt's level + trend follows the first with no history at all — on the first day the forecast
`lead_s` ahead is the level plus the trend over the lead, so a rise is extrapolated before it arrives — and the
seasonal factors, one per `bucket_s` of the day, learn the second: after a day the forecast knows the 9 o'clock
rise is coming before any of it is seen. ARIMA would need a fitted order per series and a solver in the planner;
this needs three weights and a list, and its whole state fits the planner's state file (`to_state`,
`from_state`).

One predictor per series: the planner keeps one for prompt tokens/s and one for output tokens/s, since prefill
and decode load move apart. Observations come once per planning interval; `forecast(t, lead_s)` is the series at
`t + lead_s` (never below zero).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

DAY_S = 86_400.0


@dataclass
class SeasonalTrend:
    """Holt-Winters over one series observed every `interval_s`: Holt's level and trend on the series divided by
    its daily profile, and the profile (each bucket's mean over the day's mean) learned from whole days."""

    interval_s: float
    bucket_s: float = 900.0  # one seasonal factor per quarter hour of the day
    alpha: float = 0.3  # weight of the newest observation in the level
    beta: float = 0.05  # weight of the newest level change in the trend (small: noise over the lead is amplified)
    gamma: float = 0.5  # weight of the newest day in a bucket's seasonal factor
    period_s: float = DAY_S
    level: float | None = None  # of the deseasonalized series
    trend: float = 0.0  # change of the level per interval
    season: list[float] = field(default_factory=list)  # factor per bucket (1.0 until a day has been seen)
    seen: list[bool] = field(default_factory=list)  # whether a bucket's factor has been learned
    # how far the series ran above (or below) what was forecast for it, per observation (the newest
    # `error_window`): the spread a forecast's upper bound adds (`predict`)
    errors: list[float] = field(default_factory=list)
    error_window: int = 120
    _pending: list[tuple[float, float]] = field(default_factory=list, repr=False)  # (for t, forecast) not yet seen
    _day: int | None = field(default=None, repr=False)  # the day being accumulated
    _sums: dict[int, list[float]] = field(default_factory=dict, repr=False)  # bucket -> [sum, count] today

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.bucket_s <= 0 or self.period_s % self.bucket_s:
            raise ValueError(f"interval ({self.interval_s}) and bucket ({self.bucket_s}) must be positive, the "
                             f"bucket dividing the period ({self.period_s})")
        if not all(0 < w <= 1 for w in (self.alpha, self.beta, self.gamma)):
            raise ValueError("alpha, beta and gamma must be in (0, 1]")
        n = int(self.period_s // self.bucket_s)
        self.season = self.season or [1.0] * n
        self.seen = self.seen or [False] * n
        if len(self.season) != n or len(self.seen) != n:
            raise ValueError(f"a season of {len(self.season)} buckets, expected {n}")

    def bucket(self, t_s: float) -> int:
        return int((t_s % self.period_s) // self.bucket_s)

    def factor(self, t_s: float) -> float:
        """The seasonal factor of `t_s`'s bucket (1.0 until a day has taught it)."""
        b = self.bucket(t_s)
        return self.season[b] if self.seen[b] and self.season[b] > 0 else 1.0

    def peak_factor(self, t_s: float, lead_s: float) -> float:
        """The largest factor of the buckets from `t_s` to `t_s + lead_s`: capacity asked for now serves that
        whole span, so a rise inside it counts (and a step at a bucket boundary is seen `lead_s` early)."""
        first = math.floor(t_s / self.bucket_s)
        last = math.floor((t_s + lead_s) / self.bucket_s)
        return max(self.factor(k * self.bucket_s) for k in range(first, last + 1))

    def observe(self, t_s: float, value: float) -> None:
        """The series' mean over the interval ending at `t_s` (seconds on the clock the day is measured on)."""
        value = max(value, 0.0)
        due = [f for at, f in self._pending if at <= t_s + self.interval_s / 2]
        if due:  # (the forecast made for this interval, one lead ago)
            self.errors.append(value - due[-1])
            del self.errors[: -self.error_window]
            self._pending = [(at, f) for at, f in self._pending if at > t_s + self.interval_s / 2]
        day = math.floor(t_s / self.period_s)
        if self._day is not None and day != self._day:
            self._learn_day(t_s)
        self._day = day
        acc = self._sums.setdefault(self.bucket(t_s), [0.0, 0.0])
        acc[0] += value
        acc[1] += 1
        x = value / self.factor(t_s)
        if self.level is None:
            self.level = x
            return
        level = self.alpha * x + (1 - self.alpha) * (self.level + self.trend)
        self.trend = self.beta * (level - self.level) + (1 - self.beta) * self.trend
        self.level = max(level, 0.0)

    def _learn_day(self, t_s: float) -> None:
        """A day ended: each bucket it observed gets its mean over the day's mean as its factor (blended with what
        earlier days taught), and the level is re-expressed against the new factors."""
        means = {b: total / n for b, (total, n) in self._sums.items() if n}
        day_mean = sum(means.values()) / len(means) if means else 0.0
        if day_mean > 0:
            old = self.factor(t_s)
            for b, m in means.items():
                ratio = m / day_mean
                self.season[b] = ratio if not self.seen[b] else self.gamma * ratio + (1 - self.gamma) * self.season[b]
                self.seen[b] = True
            new = self.factor(t_s)
            if self.level is not None and new > 0:
                self.level *= old / new
                self.trend *= old / new
        self._sums.clear()

    def forecast(self, t_s: float, lead_s: float) -> float:
        """The series over the next `lead_s` from `t_s` — the trend carried `lead_s` ahead, times the day's
        highest factor in that span — from what was observed up to `t_s`."""
        if self.level is None:
            return 0.0
        return max((self.level + self.trend * lead_s / self.interval_s) * self.peak_factor(t_s, lead_s), 0.0)

    def predict(self, t_s: float, lead_s: float, quantile: float) -> tuple[float, float]:
        """(`forecast(t_s, lead_s)`, its upper bound): the forecast plus the `quantile` of how far the series has run
        above its forecasts (none until ten have been checked), the forecast being remembered so that the
        observation at `t_s + lead_s` measures its error. An empirical prediction interval: on a load that swings
        within a start-up time (Azure's code hour: 0 to 70 requests/s from one minute to the next) the upper
        bound holds the capacity a forecast of the mean would drain; on a smooth day it is close to the forecast."""
        point = self.forecast(t_s, lead_s)
        self._pending.append((t_s + lead_s, point))
        if len(self.errors) < 10:
            return point, point
        ordered = sorted(self.errors)
        spread = ordered[min(int(quantile * len(ordered)), len(ordered) - 1)]
        return point, point + max(spread, 0.0)

    # -- the state file ------------------------------------------------------------------------------

    def to_state(self) -> dict[str, object]:
        return {"level": self.level, "trend": self.trend, "bucket_s": self.bucket_s,
                "season": [round(s, 6) for s in self.season], "seen": list(self.seen),
                "errors": [round(e, 3) for e in self.errors]}

    def from_state(self, state: dict[str, object]) -> None:
        """Go on from `to_state()`. Raises ValueError when it is not such a state or has another bucket size."""
        level, trend, season, seen = state.get("level"), state.get("trend"), state.get("season"), state.get("seen")
        errors = state.get("errors", [])  # (a state written before errors were kept has none)
        n = len(self.season)
        if (state.get("bucket_s") != self.bucket_s or not (level is None or isinstance(level, (int, float)))
                or not isinstance(trend, (int, float)) or not isinstance(season, list) or len(season) != n
                or not all(isinstance(s, (int, float)) and s >= 0 for s in season)
                or not isinstance(seen, list) or len(seen) != n or not all(isinstance(s, bool) for s in seen)
                or not isinstance(errors, list) or not all(isinstance(e, (int, float)) for e in errors)):
            raise ValueError(f"not a predictor state for {n} buckets of {self.bucket_s:g} s")
        self.level = None if level is None else float(level)
        self.trend = float(trend)
        self.season = [float(s) for s in season]
        self.seen = list(seen)
        self.errors = [float(e) for e in errors][-self.error_window:]
