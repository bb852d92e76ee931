"""The router's Prometheus metrics (its own registry; in-flight tokens read at scrape time)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from router.core.endpoints import EndpointRegistry

LATENCY = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30, 60)
ITL = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2, 5, 10)


class LoopHistogram:
    """A Prometheus histogram for code on the event loop only (the router's one thread):
    `observe` is a bisect and two additions (~0.3 us), where prometheus_client's Histogram takes
    a lock for the bucket and another for the sum (~3 us) — paid per streamed token for the
    inter-token latency. Scraped through `collect` with the same series names."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]):
        self.name = name
        self.documentation = documentation
        self.bounds = list(buckets)
        self.counts = [0] * (len(buckets) + 1)  # the last is +Inf
        self.sum = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        """`n` observations of `value` (tokens that arrived together share the gap)."""
        self.counts[bisect_left(self.bounds, value)] += n  # bucket le=b counts values <= b
        self.sum += value * n

    def collect(self) -> Iterator[HistogramMetricFamily]:
        cumulative, out = 0, []
        for bound, count in zip([*self.bounds, float("inf")], self.counts, strict=True):
            cumulative += count
            out.append((floatToGoString(bound), cumulative))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=out, sum_value=self.sum)


class TenantStats:
    """Per-tenant counters for code on the event loop only, as `LoopHistogram`: plain additions per
    request (prometheus_client's labelled children lock on every update), scraped through `collect`.
    Tenants are named in --api-keys: a bounded set of series."""

    def __init__(self) -> None:
        self.requests: dict[str, int] = {}
        self.tokens: dict[tuple[str, str], int] = {}
        self.throttled: dict[tuple[str, str], int] = {}
        self.queue: dict[str, LoopHistogram] = {}

    def admitted(self, tenant: str, queued_s: float) -> None:
        self.requests[tenant] = self.requests.get(tenant, 0) + 1
        h = self.queue.get(tenant)
        if h is None:
            h = self.queue[tenant] = LoopHistogram("", "", LATENCY)
        h.observe(queued_s)

    def used(self, tenant: str, prompt: int, completion: int) -> None:
        for kind, n in (("prompt", prompt), ("completion", completion)):
            self.tokens[tenant, kind] = self.tokens.get((tenant, kind), 0) + n

    def throttle(self, tenant: str, limit: str) -> None:
        self.throttled[tenant, limit] = self.throttled.get((tenant, limit), 0) + 1

    def collect(self) -> Iterator[Any]:
        req = CounterMetricFamily("splitfire_tenant_requests", "Requests admitted, by tenant", labels=["tenant"])
        for t, n in self.requests.items():
            req.add_metric([t], n)
        tok = CounterMetricFamily("splitfire_tenant_tokens", "Tokens by tenant: prompt, completion",
                                  labels=["tenant", "kind"])
        for (t, kind), n in self.tokens.items():
            tok.add_metric([t, kind], n)
        thr = CounterMetricFamily("splitfire_tenant_throttled", "Requests refused with 429 by the tenant's quotas, "
                                  "by the limit reached", labels=["tenant", "limit"])
        for (t, limit), n in self.throttled.items():
            thr.add_metric([t, limit], n)
        queue = HistogramMetricFamily("splitfire_tenant_queue_seconds", "Time waiting for an admission slot, by "
                                      "tenant", labels=["tenant"])
        for t, h in self.queue.items():
            cumulative, buckets = 0, []
            for bound, count in zip([*h.bounds, float("inf")], h.counts, strict=True):
                cumulative += count
                buckets.append((floatToGoString(bound), cumulative))
            queue.add_metric([t], buckets, h.sum)
        yield from (req, tok, thr, queue)


class ModelStats:
    """Requests and tokens by the model a request named — the base model or a LoRA adapter — on the
    event loop only, like `TenantStats`; the names are the served models' (a bounded set)."""

    def __init__(self) -> None:
        self.requests: dict[str, int] = {}
        self.tokens: dict[tuple[str, str], int] = {}

    def used(self, model: str, prompt: int, completion: int) -> None:
        self.requests[model] = self.requests.get(model, 0) + 1
        for kind, n in (("prompt", prompt), ("completion", completion)):
            self.tokens[model, kind] = self.tokens.get((model, kind), 0) + n

    def collect(self) -> Iterator[Any]:
        req = CounterMetricFamily("splitfire_router_model_requests", "Requests served, by the model (or LoRA "
                                  "adapter) named", labels=["model"])
        for m, n in self.requests.items():
            req.add_metric([m], n)
        tok = CounterMetricFamily("splitfire_router_model_tokens", "Tokens by model (or LoRA adapter): prompt, "
                                  "completion", labels=["model", "kind"])
        for (m, kind), n in self.tokens.items():
            tok.add_metric([m, kind], n)
        yield from (req, tok)


class _EndpointCollector:
    def __init__(self, registry: EndpointRegistry):
        self.endpoints = registry

    def collect(self):
        load = GaugeMetricFamily("splitfire_router_inflight_tokens", "Estimated tokens in flight per endpoint",
                                 labels=["role", "endpoint"])
        active = GaugeMetricFamily("splitfire_router_inflight_requests", "Requests in flight per endpoint",
                                   labels=["role", "endpoint"])
        healthy = GaugeMetricFamily("splitfire_router_endpoint_healthy", "1 if the endpoint is in rotation",
                                    labels=["role", "endpoint"])
        for ep in self.endpoints.all():
            healthy.add_metric([ep.role, ep.address], 1 if ep.healthy else 0)
            if ep.healthy:  # an ejected endpoint's last load is not a load (its series goes away)
                load.add_metric([ep.role, ep.address], ep.load())
                active.add_metric([ep.role, ep.address], ep.active)
        yield from (load, active, healthy)


@dataclass
class RouterMetrics:
    endpoints: EndpointRegistry
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter("splitfire_router_requests", "HTTP requests by route and status", ["route", "status"], registry=r)
        self.ttft = LoopHistogram("splitfire_router_ttft_seconds", "Time to first token at the router", LATENCY)
        self.itl = LoopHistogram("splitfire_router_inter_token_seconds", "Time between streamed tokens", ITL)
        self.e2e = LoopHistogram("splitfire_router_request_seconds", "Whole request time", LATENCY)
        for h in (self.ttft, self.itl, self.e2e):
            r.register(h)
        self.decisions = Counter("splitfire_router_routing_decisions", "Placements by policy, role and endpoint",
                                 ["policy", "role", "endpoint"], registry=r)
        self.affinity = Counter("splitfire_router_affinity", "Session-affinity lookups: hit, miss, break",
                                ["result"], registry=r)
        self.retries = Counter("splitfire_router_retries", "Attempts re-sent elsewhere: retry (before the first "
                               "token) or failover (mid-stream)", ["kind"], registry=r)
        self.queue = Gauge("splitfire_router_queue_depth", "Requests waiting for an admission slot", registry=r)
        self.running = Gauge("splitfire_router_running_requests", "Requests holding an admission slot", registry=r)
        self.admission_refused = Counter("splitfire_router_admission_refused", "Requests refused or shed by "
                                         "admission: priority_shed (429) or no_capacity (503)", ["reason"], registry=r)
        self.prompt_tokens = Counter("splitfire_router_prompt_tokens", "Prompt tokens routed", registry=r)
        # (arrivals: splitfire_router_requests counts a request when it ends, by status)
        self.requests_started = Counter("splitfire_router_requests_started", "Generation requests routed, counted "
                                        "when they arrive", registry=r)
        self.completion_tokens = Counter("splitfire_router_completion_tokens", "Tokens streamed back", registry=r)
        # (with the sums and counts above, the lengths' spread: the planner's queue and context weighting read it)
        self.prompt_tokens_squared = Counter("splitfire_router_prompt_tokens_squared", "Sum over arrived requests of "
                                             "their prompt tokens squared", registry=r)
        self.completion_tokens_squared = Counter("splitfire_router_completion_tokens_squared", "Sum over ended "
                                                 "requests of their tokens streamed back, squared", registry=r)
        self.cached_tokens = Counter("splitfire_router_cached_prompt_tokens", "Prompt tokens workers served from "
                                     "their prefix caches", registry=r)
        self.tenants = TenantStats()
        self.models = ModelStats()
        r.register(self.tenants)
        r.register(self.models)
        r.register(_EndpointCollector(self.endpoints))
        self._children: dict[tuple, Any] = {}

    def child(self, metric: Counter, *labels: str) -> Any:
        """`metric.labels(*labels)`, memoized: labels() validates and locks on every call, and the
        router asks for the same few children on every request."""
        key = (metric, *labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c
