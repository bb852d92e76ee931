"""Starting a worker process and stopping it cleanly: load, serve gRPC + /metrics, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import signal
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import torch
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from common import gc_heap
from common.errors import RequestError
from common.tokenizer import Tokenizer
from common.tracing import Tracing
from engine.async_engine import AsyncEngine
from engine.compute_threads import releasing
from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loading import weight_cache
from engine.loading.model_store import resolve_model
from engine.outputs import RequestOutput, StepObserver
from kvtransfer.descriptors import KVRegion
from worker.config import WorkerConfig
from worker.kv.rank import rank_main, register_cache
from worker.metrics import WorkerMetrics
from worker.model_host import HostedModel, HostLimits, ModelHost
from worker.worker_service import WorkerContext

if TYPE_CHECKING:
    from kvtransfer.transport import MooncakeTransport

log = logging.getLogger("splitfire.worker")

GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 2**20),
    # A decode worker's channel to a restarted prefill worker reconnects within a second.
    ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_send_message_length", 64 * 2**20),
    ("grpc.so_reuseport", 0),
]


def apply_cpu_affinity(cfg: WorkerConfig) -> None:
    if cfg.cpus:
        os.sched_setaffinity(0, cfg.cpus)
        if cfg.engine.threads is None:
            cfg.engine.threads = len(cfg.cpus)
        log.info("event=cpu_affinity cpus=%s threads=%d", cfg.cpus, cfg.engine.threads)
    if cfg.engine.threads:
        torch.set_num_threads(cfg.engine.threads)


def register_kv(transport: MooncakeTransport, llm: LLMEngine) -> KVRegion:
    """Make the engine's KV cache writable by peers (prefill workers write into a decode worker's)."""
    return register_cache(transport, llm.kv)


def load_context(cfg: WorkerConfig, observer: StepObserver | None = None,
                 engine: LLMEngine | None = None) -> WorkerContext:
    apply_cpu_affinity(cfg)
    store_cfg = None
    if cfg.kv_store:
        from kvtransfer.store import StoreConfig

        store_cfg = StoreConfig(cfg.kv_store, cfg.transfer.hostname, int(cfg.kv_store_gb * 2**30),
                                cfg.transfer.protocol, cfg.transfer.device_name)
    if engine is None:
        # A prefill or decode worker's other model-parallel ranks take part in the KV transfer, and with
        # a store every rank publishes and fetches its own pages (the memory lent is rank 0's alone).
        transfer = cfg.transfer if cfg.role != "both" else None
        main = (rank_main(transfer, dataclasses.replace(store_cfg, lend_bytes=0) if store_cfg else None)
                if transfer is not None or store_cfg is not None else None)
        engine = LLMEngine(cfg.engine, main)
    metrics = WorkerMetrics(cfg.role)
    ctx = WorkerContext(cfg, AsyncEngine(engine, observer), metrics, model_name=engine.model_dir.name,
                        adapters=engine.adapters,
                        tracing=Tracing.from_env("splitfire-" + ("colocated" if cfg.role == "both" else cfg.role)))
    if cfg.redis_url:
        # Routers build an exact prefix index from these (router/kv_events.py).
        from worker.kv.events import KVEventPublisher

        ctx.kv_events = KVEventPublisher(cfg.redis_url, cfg.advertise)
        ctx.engine.on_kv_events = ctx.kv_events.on_kv_events
    metrics.kv_total.labels(**metrics.labels).set(engine.blocks.num_blocks)
    metrics.adapters_resident.labels(**metrics.labels).set(len(engine.adapters))
    if store_cfg is not None:
        from kvtransfer.store import KVStore
        from worker.kv.tier import KVTier

        agents = [info.store for info in engine.ranks.rank_info] if engine.ranks is not None else []
        ctx.kv_tier = KVTier(KVStore(store_cfg), ctx.engine, metrics, agents=agents)
        ctx.kv_tier.store.ready()  # connect now if the master answers; otherwise serve without it and retry later
    return ctx


@dataclass
class ResidentModel:
    """A base model loaded in this worker: its context (engine, shared metrics and in-flight set) and the
    role's service over it."""

    ctx: WorkerContext
    service: Any


def _hosted_engine_config(cfg: WorkerConfig, path: str) -> EngineConfig:
    """A model loaded on demand: the worker's engine settings, without what belongs to its first model
    (its --lora-modules, a draft model or EAGLE head). With LoRA on, it has adapter slots of its own."""
    spec = cfg.engine.speculative if cfg.engine.speculative == "ngram" else "off"
    return dataclasses.replace(cfg.engine, model=path, lora_modules={}, enable_lora=cfg.engine.lora,
                               speculative=spec, draft_model=None)


def _footprint(engine: LLMEngine) -> int:
    return weight_cache.nbytes(engine.model) + engine.kv.nbytes


def _estimate(cfg: WorkerConfig, m: HostedModel) -> int:
    """A model never loaded here: its weight files and a KV cache of --kv-cache-gb."""
    path = Path(m.path)
    files = [path] if path.is_file() else [f for f in path.iterdir()
                                           if f.suffix in (".safetensors", ".gguf", ".bin", ".pt")]
    return sum(f.stat().st_size for f in files) + int(cfg.engine.kv_cache_gb * 2**30)


def host_models(ctx: WorkerContext, make_service: Callable[[WorkerContext], Any]) -> ModelHost:
    """The models of a worker started with --on-demand-model: its first (`ctx`, resident for good) and the
    others, loaded when a request names one (`worker/model_host.py`)."""
    cfg, m = ctx.config, ctx.metrics
    first = HostedModel(ctx.model_name, str(ctx.engine.llm.model_dir), ResidentModel(ctx, make_service(ctx)),
                        _footprint(ctx.engine.llm), pinned=True)
    others = [HostedModel(d.name, str(d)) for d in map(resolve_model, cfg.on_demand_models)]
    tokenizers: dict[str, Tokenizer] = {}  # kept across evictions: a reload then only maps the weights

    async def load(hm: HostedModel) -> tuple[ResidentModel, int]:
        engine = await asyncio.to_thread(releasing(LLMEngine), _hosted_engine_config(cfg, hm.path), None,
                                         tokenizers.get(hm.name))
        tokenizers[hm.name] = engine.tokenizer
        for name, path in list(hm.adapters.items()):  # (loaded for it at run time: back in its new engine)
            try:
                await asyncio.to_thread(releasing(engine.load_adapter), name, path)
            except RequestError as e:  # (its files changed since): dropped, named in the log and metrics
                log.error("event=lora_reinstall_failed model=%s name=%s path=%s error=%s", hm.name, name, path, e)
                m.adapter_loads.labels(role=m.role, op="refused").inc()
                del hm.adapters[name]
        sub = WorkerContext(cfg, AsyncEngine(engine), m, model_name=hm.name, inflight=ctx.inflight,
                            tracing=ctx.tracing)
        sub.engine.on_step = _on_step(sub)
        sub.engine.start()
        return ResidentModel(sub, make_service(sub)), _footprint(engine)

    async def unload(hm: HostedModel) -> None:
        resident: ResidentModel = hm.resident
        hm.resident = None
        await resident.ctx.engine.stop()
        engine = weakref.ref(resident.ctx.engine.llm)
        resident.ctx.engine.llm.close()
        del resident
        gc.collect()  # (the engine's own reference cycles: its memory goes back now, not at some later collection)
        log.info("event=model_freed model=%s freed=%s", hm.name, engine() is None)

    def changed(op: str, hm: HostedModel, seconds: float) -> None:
        m.model_loads.labels(role=m.role, model=hm.name, op=op).inc()
        if op == "loaded":
            m.model_load_seconds.labels(**m.labels).observe(seconds)
        m.models_resident.labels(**m.labels).set(len(host.resident()))

    limits = HostLimits(cfg.max_loaded_models, int(cfg.model_memory_gb * 2**30), cfg.reserve_timeout_s)
    host = ModelHost([first, *others], limits, load, unload, lambda hm: _estimate(cfg, hm), changed)
    m.models_resident.labels(**m.labels).set(1)
    return host


def _on_step(ctx: WorkerContext):
    m, lbl = ctx.metrics, ctx.metrics.labels

    def update(outputs: list[RequestOutput], step_s: float, running: int) -> None:
        m.step.labels(**lbl).observe(step_s)

    return update


def refresh_gauges(ctx: WorkerContext) -> None:
    """Gauges from the engine's snapshot, taken after every step and every command (an abort
    included) and when it goes idle: a scrape sees the engine as it is, never a stale busy state."""
    st, m, lbl = ctx.engine.stats, ctx.metrics, ctx.metrics.labels
    b = st.blocks
    m.batch.labels(**lbl).set(st.running)
    m.queue.labels(**lbl).set(st.waiting)
    m.kv_used.labels(**lbl).set(b.used)
    m.kv_cached.labels(**lbl).set(b.cached)
    if b.prefix_query_tokens:
        m.prefix_hit.labels(**lbl).set(b.prefix_hit_tokens / b.prefix_query_tokens)
    m.preemptions.labels(**lbl).set(st.num_preemptions)
    if st.spec_drafted:
        m.spec_tokens.labels(**lbl, kind="drafted").set(st.spec_drafted)
        m.spec_tokens.labels(**lbl, kind="accepted").set(st.spec_accepted)
    m.prefix_hit_tokens.labels(role=m.role, tier="local").set(b.prefix_hit_tokens)
    m.prefix_hit_tokens.labels(role=m.role, tier="store").set(st.store_hit_tokens)


async def _metrics_app(ctx: WorkerContext, add_routes: Callable[[web.Application], None] | None) -> web.AppRunner:
    async def metrics(_: web.Request) -> web.Response:
        refresh_gauges(ctx)
        return web.Response(body=generate_latest(ctx.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(_: web.Request) -> web.Response:
        if ctx.draining:
            return web.json_response({"status": "draining"}, status=503)
        return web.json_response({"status": "serving", "role": ctx.config.role, "model": ctx.model_name})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    if add_routes is not None:
        add_routes(app)
    # A client that goes away cancels its handler (a token stream's request is aborted at once).
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, ctx.config.host, ctx.config.metrics_port).start()
    return runner


async def serve(ctx: WorkerContext, server: grpc.aio.Server,
                http_routes: Callable[[web.Application], None] | None = None) -> None:
    """Runs until SIGTERM/SIGINT, then drains: refuse new work, finish in-flight requests, exit.
    `http_routes` adds routes to the worker's HTTP (metrics) port: the decode roles' token stream."""
    cfg = ctx.config
    ctx.engine.on_step = _on_step(ctx)
    ctx.engine.start()
    address = f"{cfg.host}:{cfg.grpc_port}"
    if server.add_insecure_port(address) == 0:
        raise OSError(f"cannot bind gRPC port {address}")
    await server.start()
    metrics_runner = await _metrics_app(ctx, http_routes)
    ctx.stream_port = cfg.metrics_port if http_routes is not None else 0
    if ctx.kv_tier is not None:
        ctx.kv_tier.start()
    if ctx.kv_events is not None:
        ctx.kv_events.start()
    heartbeat = None
    if cfg.redis_url:
        from worker.registration import heartbeat_loop

        heartbeat = asyncio.create_task(heartbeat_loop(ctx))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("event=worker_ready role=%s grpc=%s metrics=%s:%d advertise=%s model=%s",
             cfg.role, address, cfg.host, cfg.metrics_port, cfg.advertise, ctx.model_name)
    print(f"splitfire {cfg.role} worker ready on {address}", flush=True)
    gc_heap.release(f"{cfg.role} worker")
    await stop.wait()
    ctx.draining = True
    log.info("event=draining inflight=%d timeout_s=%.0f", len(ctx.inflight), cfg.drain_timeout_s)
    deadline = time.monotonic() + cfg.drain_timeout_s
    while ctx.inflight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if ctx.inflight:
        log.warning("event=drain_timeout abandoned=%d", len(ctx.inflight))
    if heartbeat is not None:
        heartbeat.cancel()
    if ctx.kv_events is not None:
        await ctx.kv_events.stop()
    await server.stop(grace=1.0)
    await metrics_runner.cleanup()
    if ctx.kv_tier is not None:
        await ctx.kv_tier.stop()
    if ctx.host is not None:
        await ctx.host.close()
    await ctx.engine.stop()
    if ctx.tracing is not None:
        await asyncio.to_thread(ctx.tracing.shutdown)  # (exports what is queued)
    log.info("event=worker_stopped role=%s", cfg.role)


def new_server() -> grpc.aio.Server:
    return grpc.aio.server(options=GRPC_OPTIONS)
