"""The router's lock-free histogram scrapes exactly like prometheus_client's own."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from router.core.metrics import ITL, LoopHistogram


def _lines(registry: CollectorRegistry) -> list[str]:
    return [ln for ln in generate_latest(registry).decode().splitlines() if "_created" not in ln]


def test_loop_histogram_exposes_what_prometheus_histogram_does():
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    h = LoopHistogram("x_seconds", "doc", ITL)
    ours.register(h)
    ref = Histogram("x_seconds", "doc", buckets=ITL, registry=theirs)
    rng = random.Random(0)
    for _ in range(2000):
        v = rng.choice([rng.random() * 0.3, rng.choice(ITL), 5.0, 0.0])  # bucket edges and +Inf too
        n = rng.randint(1, 3)
        h.observe(v, n)
        for _ in range(n):
            ref.observe(v)
    assert _lines(ours)[:-1] == _lines(theirs)[:-1]  # all buckets and the count
    ours_sum, theirs_sum = (float(_lines(r)[-1].split()[-1]) for r in (ours, theirs))
    assert abs(ours_sum - theirs_sum) < 1e-6 * theirs_sum  # v * n vs n additions of v
