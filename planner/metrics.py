"""A planner snapshot from two scrapes of a router's /metrics: what happened between them.

Rates and means come from counter differences (requests arrived and ended, prompt, completion and cached
tokens), the TTFT and inter-token p90 from histogram bucket differences (the interval's own distribution,
not the process lifetime's), the fleet from `splitfire_router_endpoint_healthy` (colocated workers count
as both roles' capacity: they prefill and decode).
"""

from __future__ import annotations

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


def snapshot(before: Scrape, after: Scrape) -> Snapshot:
    dt = max(after.at_s - before.at_s, 1e-9)

    def delta(name: str) -> float:
        return after.counters.get(name, 0.0) - before.counters.get(name, 0.0)

    # Arrivals (with the prompt tokens, counted at arrival too) set the rate and the mean prompt; the requests
    # that ended (with their completion tokens) the mean output. A router without the arrivals counter:
    # the ended requests for both.
    finished = delta("splitfire_router_requests_total")
    started = "splitfire_router_requests_started_total"
    requests = delta(started) if started in after.counters else finished
    prompt, completion = delta("splitfire_router_prompt_tokens_total"), delta("splitfire_router_completion_tokens_total")
    cached = delta("splitfire_router_cached_prompt_tokens_total")
    colocated = after.healthy.get("colocated", 0)

    def p90(name: str) -> float:
        return quantile(before.buckets.get(name, []), after.buckets.get(name, []), 0.9)

    return Snapshot(
        request_rate=requests / dt,
        mean_input_tokens=prompt / requests if requests else 0.0,
        mean_output_tokens=completion / finished if finished else 0.0,
        prefix_hit_ratio=cached / prompt if prompt else 0.0,
        ttft_p90_s=p90("splitfire_router_ttft_seconds"),
        itl_p90_s=p90("splitfire_router_inter_token_seconds"),
        prefill_workers=after.healthy.get("prefill", 0) + colocated,
        decode_workers=after.healthy.get("decode", 0) + colocated,
    )
