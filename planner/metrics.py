"""A planner snapshot from the scrapes of a router's /metrics over one interval: what happened between them.

Rates and means come from counter differences (requests arrived and ended, prompt, completion and cached
tokens; the prompts' and answers' squared lengths give their spread), the TTFT and inter-token p90 from
histogram bucket differences (the interval's own distribution, not the process lifetime's), the fleet from
`splitfire_router_endpoint_healthy` (colocated workers count as both roles' capacity: they prefill and
decode). The scrapes in between (every few seconds) give the arrivals' bursts: the most prompt tokens/s over
windows of one, two and six samples (`prompt_peaks`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from planner.decision import Snapshot

GENERATION_ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/responses"}  # (not /health, /metrics...)


@dataclass
class Scrape:
    at_s: float
    counters: dict[str, float] = field(default_factory=dict)  # sample name -> value, summed over labels
    buckets: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # histogram -> [(le, count)]
    healthy: dict[str, int] = field(default_factory=dict)  # role -> endpoints in rotation

    @staticmethod
    def parse(text: str, at_s: float) -> Scrape:
        s = Scrape(at_s)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name, labels, value = sample.name, sample.labels, sample.value
                if name.endswith("_bucket"):
                    le = float(labels["le"])
                    rows = s.buckets.setdefault(name[: -len("_bucket")], [])
                    for i, (b, c) in enumerate(rows):
                        if b == le:
                            rows[i] = (b, c + value)
                            break
                    else:
                        rows.append((le, value))
                elif name == "splitfire_router_requests_total":
                    if labels.get("route") in GENERATION_ROUTES:
                        s.counters[name] = s.counters.get(name, 0.0) + value
                elif name == "splitfire_router_endpoint_healthy":
                    s.healthy[labels["role"]] = s.healthy.get(labels["role"], 0) + int(value)
                elif name.endswith("_total"):
                    s.counters[name] = s.counters.get(name, 0.0) + value
        for rows in s.buckets.values():
            rows.sort()
        return s


def _count(before: Scrape, after: Scrape, histogram: str) -> float:
    """What a histogram counted between two scrapes (its +Inf bucket's difference)."""
    def total(s: Scrape) -> float:
        rows = s.buckets.get(histogram, [])
        return rows[-1][1] if rows else 0.0
    return total(after) - total(before)


def quantile(before: list[tuple[float, float]], after: list[tuple[float, float]], q: float) -> float:
    """The q-quantile of what a histogram observed between two scrapes (a bucket's upper bound)."""
    prior = dict(before)
    counts = [(le, c - prior.get(le, 0.0)) for le, c in after]
    total = counts[-1][1] if counts else 0.0
    if total <= 0:
        return 0.0
    for le, c in counts:
        if c >= q * total:
            return le
    return counts[-1][0]


PEAK_SAMPLES = (1, 2, 6)  # the burst windows, in samples


def prompt_peaks(bins: list[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    """(window seconds, the most prompt tokens/s over any run of that many consecutive samples) for each of
    `PEAK_SAMPLES` shorter than the whole interval, from (seconds, prompt tokens) per sample in time order.
    A window's length is its samples' mean length times their count."""
    if not bins:
        return ()
    mean_s = sum(dt for dt, _ in bins) / len(bins)
    out = []
    for k in PEAK_SAMPLES:
        if k >= len(bins):
            break
        best = max(sum(n for _, n in bins[i : i + k]) / max(sum(dt for dt, _ in bins[i : i + k]), 1e-9)
                   for i in range(len(bins) - k + 1))
        out.append((round(k * mean_s, 3), best))
    return tuple(out)


PROMPT_TOKENS = "splitfire_router_prompt_tokens_total"


def snapshot(before: Scrape, after: Scrape, between: list[Scrape] | None = None) -> Snapshot:
    """The interval from `before` to `after`; `between`: the scrapes taken inside it (time order), for the
    bursts."""
    dt = max(after.at_s - before.at_s, 1e-9)
    points = [before, *(between or []), after]
    bins = [(b.at_s - a.at_s, b.counters.get(PROMPT_TOKENS, 0.0) - a.counters.get(PROMPT_TOKENS, 0.0))
            for a, b in itertools.pairwise(points)]

    def delta(name: str) -> float:
        return after.counters.get(name, 0.0) - before.counters.get(name, 0.0)

    # Arrivals (with the prompt tokens, counted at arrival too) set the rate and the mean prompt; the requests
    # that ended (with their completion tokens) the mean output. A router without the arrivals counter:
    # the ended requests for both.
    finished = delta("splitfire_router_requests_total")
    started = "splitfire_router_requests_started_total"
    requests = delta(started) if started in after.counters else finished
    prompt, completion = delta(PROMPT_TOKENS), delta("splitfire_router_completion_tokens_total")
    cached = delta("splitfire_router_cached_prompt_tokens_total")
    colocated = after.healthy.get("colocated", 0)

    def p90(name: str) -> float:
        return quantile(before.buckets.get(name, []), after.buckets.get(name, []), 0.9)

    def cv2(total: float, squares: str, n: float) -> float | None:
        """The squared coefficient of variation of n lengths from their sum and sum of squares (None: fewer than
        two, or a router that does not count the squares)."""
        if n < 2 or total <= 0 or squares not in after.counters:
            return None
        mean = total / n
        return max(delta(squares) / n / (mean * mean) - 1.0, 0.0)

    return Snapshot(
        request_rate=requests / dt,
        mean_input_tokens=prompt / requests if requests else 0.0,
        mean_output_tokens=completion / finished if finished else 0.0,
        prefix_hit_ratio=cached / prompt if prompt else 0.0,
        ttft_p90_s=p90("splitfire_router_ttft_seconds"),
        itl_p90_s=p90("splitfire_router_inter_token_seconds"),
        prefill_workers=after.healthy.get("prefill", 0) + colocated,
        decode_workers=after.healthy.get("decode", 0) + colocated,
        prompt_peaks=prompt_peaks(bins) if between else (),
        first_token_rate=_count(before, after, "splitfire_router_ttft_seconds") / dt,
        prompt_cv2=cv2(prompt, "splitfire_router_prompt_tokens_squared_total", requests),
        output_cv2=cv2(completion, "splitfire_router_completion_tokens_squared_total", finished),
    )
