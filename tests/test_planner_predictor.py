"""planner/predictor.py: the load one start-up time ahead — a daily rise foreseen once a day has been seen, a
trend followed from the first interval, and the state kept across restarts."""

from __future__ import annotations

import json
import random

import pytest

from planner.predictor import DAY_S, SeasonalTrend

INTERVAL = 60.0
LEAD = 300.0  # a new worker's start-up


def office_hours(t: float) -> float:
    """Requests' prompt tokens/s on a day that jumps 5x at 09:00 and falls back at 18:00."""
    hour = (t % DAY_S) / 3600
    return 500.0 if 9 <= hour < 18 else 100.0


def run(series, days: float, noise: float = 0.1, seed: int = 0):
    """Observe `series` every interval with multiplicative noise; yield (t, observed, predictor)."""
    rng = random.Random(seed)
    p = SeasonalTrend(interval_s=INTERVAL)
    for i in range(1, int(days * DAY_S / INTERVAL)):
        t = i * INTERVAL
        v = series(t) * (1 + rng.gauss(0, noise))
        p.observe(t, v)
        yield t, v, p


def test_after_a_day_the_morning_rise_is_foreseen_a_start_up_ahead():
    forecast_at: dict[int, float] = {}
    actual_at: dict[int, float] = {}
    for t, _, p in run(office_hours, days=3):
        day = int(t // DAY_S)
        if office_hours(t) >= 300 and day not in actual_at:
            actual_at[day] = t
        if p.forecast(t, LEAD) >= 300 and day not in forecast_at:
            forecast_at[day] = t
    # The first day has nothing to go on: a step is seen when it happens (at most an interval late).
    assert actual_at[0] - forecast_at[0] <= INTERVAL
    # From the second day the forecast asks for capacity at least one start-up before the load arrives.
    for day in (1, 2):
        assert actual_at[day] - forecast_at[day] >= LEAD
        assert actual_at[day] - forecast_at[day] <= LEAD + 900  # and not long before (one bucket)


def test_the_evening_fall_is_believed_in_time_and_not_before():
    for t, _, p in run(office_hours, days=2.5):
        if t < DAY_S + 18 * 3600 - LEAD - 2 * INTERVAL or t > DAY_S + 18 * 3600 + 1200:
            continue
        f = p.forecast(t, LEAD)
        if t + LEAD < DAY_S + 18 * 3600:  # the load is still high within the lead: keep the capacity
            assert f >= 400, (t, f)
        elif t > DAY_S + 18 * 3600 + 900:  # past the fall's bucket: let it go
            assert f <= 200, (t, f)


def test_a_ramp_is_followed_ahead_of_its_noisy_samples():
    ramp = lambda t: 50.0 + t / 36.0  # noqa: E731 (+100 per hour)
    errs, naive = [], []
    for t, v, p in run(ramp, days=0.25):
        if t > 1800:
            errs.append(abs(p.forecast(t, LEAD) - ramp(t + LEAD)))
            naive.append(abs(v - ramp(t + LEAD)))
    assert sum(errs) / len(errs) < 0.6 * sum(naive) / len(naive)


def test_the_upper_bound_holds_a_load_that_swings_within_a_start_up_and_hugs_a_smooth_one():
    """`predict`'s upper bound: the forecast plus a quantile of how far the series ran above the forecasts made for
    it — an empirical prediction interval. On a load that jumps between quiet and busy minutes (Azure's code hour)
    the bound covers the next minute about as often as its quantile says, the forecast of the mean only about
    half the time; on a smooth load the bound stays within the noise of the forecast."""
    rng = random.Random(1)
    swinging, smooth = SeasonalTrend(interval_s=INTERVAL), SeasonalTrend(interval_s=INTERVAL)
    made: list[tuple[float, float]] = []  # (point, upper) made one interval before each observation
    covered = {"point": 0, "upper": 0}
    for i in range(1, 400):
        t = i * INTERVAL
        v = 1000.0 if rng.random() < 0.5 else 0.0
        if i > 100:
            covered["point"] += v <= made[-1][0]
            covered["upper"] += v <= made[-1][1]
        swinging.observe(t, v)
        made.append(swinging.predict(t, INTERVAL, 0.75))
        smooth.observe(t, 500.0 * (1 + rng.gauss(0, 0.05)))
        point, upper = smooth.predict(t, INTERVAL, 0.75)
        assert point <= upper <= point * 1.1, (t, point, upper)
    assert made[5][0] == made[5][1]  # (fewer than ten errors measured: the forecast alone)
    assert covered["upper"] >= 0.65 * 299 and covered["point"] <= 0.6 * 299, covered
    # the errors are part of the state: a restarted planner keeps its bound
    q = SeasonalTrend(interval_s=INTERVAL)
    q.from_state(json.loads(json.dumps(swinging.to_state())))
    t = 400 * INTERVAL
    assert q.predict(t, INTERVAL, 0.75)[1] == pytest.approx(swinging.predict(t, INTERVAL, 0.75)[1], rel=1e-4)


def test_the_state_round_trips_and_is_refused_when_foreign():
    *_, (t, _, p) = run(office_hours, days=1.2)
    state = json.loads(json.dumps(p.to_state()))
    q = SeasonalTrend(interval_s=INTERVAL)
    q.from_state(state)
    assert q.forecast(t, LEAD) == pytest.approx(p.forecast(t, LEAD), rel=1e-5)
    assert q.forecast(t + 9 * 3600, LEAD) == pytest.approx(p.forecast(t + 9 * 3600, LEAD), rel=1e-5)
    with pytest.raises(ValueError, match="not a predictor state"):
        SeasonalTrend(interval_s=INTERVAL, bucket_s=600).from_state(state)
    with pytest.raises(ValueError, match="not a predictor state"):
        q.from_state({**state, "season": state["season"][:-1]})
    with pytest.raises(ValueError, match="not a predictor state"):
        q.from_state({**state, "seen": "yes"})
    with pytest.raises(ValueError, match="not a predictor state"):
        q.from_state({**state, "errors": ["x"]})


def test_settings_are_checked():
    with pytest.raises(ValueError, match="bucket"):
        SeasonalTrend(interval_s=60, bucket_s=7)
    with pytest.raises(ValueError, match="alpha"):
        SeasonalTrend(interval_s=60, alpha=0)
    assert SeasonalTrend(interval_s=60).forecast(0.0, LEAD) == 0.0  # nothing observed yet
