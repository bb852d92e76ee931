"""Prometheus metrics of one worker process (its own registry: no global state)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 20, 60)
TOKEN_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2)


@dataclass
class WorkerMetrics:
    role: str
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r, labels = self.registry, ["role"]
        self.requests = Counter("splitfire_worker_requests", "Requests finished, by outcome", ["role", "outcome"], registry=r)
        self.ttft = Histogram("splitfire_worker_ttft_seconds", "Time to first token inside the worker", labels,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("splitfire_worker_inter_token_seconds", "Time between tokens of a request (per token)",
                             labels, buckets=TOKEN_BUCKETS, registry=r)
        self.step = Histogram("splitfire_worker_step_seconds", "Engine step time", labels, buckets=TOKEN_BUCKETS,
                              registry=r)
        self.batch = Gauge("splitfire_worker_running_batch", "Sequences in the running batch", labels, registry=r)
        self.queue = Gauge("splitfire_worker_queue_depth", "Requests waiting to be scheduled", labels, registry=r)
        self.kv_used = Gauge("splitfire_worker_kv_blocks_used", "KV blocks held by live requests", labels, registry=r)
        self.kv_cached = Gauge("splitfire_worker_kv_blocks_cached", "Unreferenced KV blocks kept for prefix hits",
                               labels, registry=r)
        self.kv_total = Gauge("splitfire_worker_kv_blocks_total", "KV blocks in all", labels, registry=r)
        self.prefix_hit = Gauge("splitfire_worker_prefix_hit_ratio", "Prompt tokens served from the prefix cache / "
                                "prompt tokens seen", labels, registry=r)
        self.transfer_bytes = Counter("splitfire_worker_kv_transfer_bytes", "KV bytes written to decode workers",
                                      labels, registry=r)
        self.transfer_entries = Counter("splitfire_worker_kv_transfer_entries", "Mooncake write entries of the KV "
                                        "written to decode workers (after coalescing)", labels, registry=r)
        self.transfer_seconds = Histogram("splitfire_worker_kv_transfer_seconds", "Wall time of one request's KV "
                                          "transfer", labels, buckets=LATENCY_BUCKETS, registry=r)
        self.prefill_mode = Counter("splitfire_worker_prefill_mode", "Where a decode worker's prompts were prefilled",
                                    ["role", "mode", "reason"], registry=r)
        self.spec_tokens = Gauge("splitfire_worker_spec_tokens", "Speculative decoding so far: tokens drafted and "
                                 "accepted (acceptance = accepted / drafted)", [*labels, "kind"], registry=r)
        self.preemptions = Gauge("splitfire_worker_preemptions", "Sequences preempted so far", labels, registry=r)
        self.prefix_hit_tokens = Gauge("splitfire_worker_prefix_hit_tokens", "Prompt tokens not computed because a "
                                       "cache held them, so far, by tier (local prefix cache, cluster-wide KV store)",
                                       ["role", "tier"], registry=r)
        self.kv_store_blocks = Counter("splitfire_worker_kv_store_blocks", "KV blocks published to, fetched from or "
                                       "dropped before the cluster-wide KV store", ["role", "op"], registry=r)
        self.adapter_requests = Counter("splitfire_worker_adapter_requests", "Requests finished under a LoRA "
                                        "adapter", ["role", "adapter"], registry=r)
        self.adapter_tokens = Counter("splitfire_worker_adapter_tokens", "Tokens of requests under a LoRA adapter",
                                      ["role", "adapter", "kind"], registry=r)
        self.adapter_loads = Counter("splitfire_worker_adapter_loads", "LoRA adapter loads at run time, by result "
                                     "(ok, refused) and unloads", ["role", "op"], registry=r)
        self.adapter_load_seconds = Histogram("splitfire_worker_adapter_load_seconds", "Time to read, check and place "
                                              "a LoRA adapter", labels, buckets=LATENCY_BUCKETS, registry=r)
        self.adapters_resident = Gauge("splitfire_worker_adapters_resident", "LoRA adapters taking requests", labels,
                                       registry=r)
        self.model_requests = Counter("splitfire_worker_model_requests", "Requests started, by base model (a worker "
                                      "hosting several)", ["role", "model"], registry=r)
        self.model_loads = Counter("splitfire_worker_model_loads", "Base models loaded on demand and evicted",
                                   ["role", "model", "op"], registry=r)
        self.model_load_seconds = Histogram("splitfire_worker_model_load_seconds", "Time to load a base model on "
                                            "demand (engine ready)", labels, buckets=LATENCY_BUCKETS, registry=r)
        self.models_resident = Gauge("splitfire_worker_models_resident", "Base models loaded now", labels, registry=r)
        self.labels = {"role": self.role}
