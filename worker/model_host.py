"""Several base models in one worker process, loaded when a request names one, the least recently used evicted.

A colocated worker started with `--on-demand-model DIR` (repeatable) serves its `--model` and those: each
resident model is an engine of its own (weights, KV cache, scheduler, engine thread) behind the same gRPC
and HTTP ports. A request for a model that is not resident loads it first — from the weight cache its
weights are mapped, not read — after evicting, least recently used first, resident models no request is
using until the new one fits in `--max-loaded-models` and `--model-memory-gb` (a model's footprint: its
weights plus its KV cache, measured when it was last loaded; before that its weight files plus
`--kv-cache-gb`). The first model is never evicted: the worker's hot standby, whose engine also answers
for the worker (its stats, its KV store tier). When nothing can be evicted (every resident model busy) the request waits for one to
go idle, up to `--reserve-timeout`, then fails RESOURCE_EXHAUSTED so the router tries another worker.

This module is the policy and the bookkeeping only: what a resident model is, how it is loaded and how
it is freed are the caller's (`worker/lifecycle.py` builds engines; tests use plain objects).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from common.errors import RequestError

log = logging.getLogger("splitfire.worker")


class ModelUnavailable(Exception):
    """No room for a model within the worker's limits right now (every resident model is busy), or ever
    (its footprint alone is above --model-memory-gb)."""


@dataclass
class HostedModel:
    name: str  # the model directory's name: what requests and health checks call it
    path: str  # what to load
    resident: Any = None  # the loaded model (the caller's object) while it is resident
    footprint: int = 0  # bytes: measured at its last load (0: not loaded yet, estimated)
    active: int = 0  # requests using it now: never evicted while above 0
    last_used: float = 0.0
    loads: int = 0
    pinned: bool = False  # never evicted (the worker's first model: its hot standby)
    evicting: bool = False  # chosen for eviction: takes no new request until it is gone (and loaded again)
    # LoRA adapters loaded for it at run time (name -> path): installed again each time it is loaded
    adapters: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class HostLimits:
    max_loaded: int = 0  # resident models at once (0: no limit)
    memory_bytes: int = 0  # sum of the resident models' footprints (0: no limit)
    wait_s: float = 30.0  # how long a request waits for room


class ModelHost:
    def __init__(self, models: list[HostedModel], limits: HostLimits,
                 load: Callable[[HostedModel], Awaitable[tuple[Any, int]]],
                 unload: Callable[[HostedModel], Awaitable[None]],
                 estimate: Callable[[HostedModel], int],
                 on_change: Callable[[str, HostedModel, float], None] | None = None):
        """`models`: every model served, the first resident already (or loaded by the first request);
        `load` returns (resident object, footprint bytes); `unload` frees `model.resident`; `estimate`:
        the footprint of a model never loaded; `on_change(op, model, seconds)`: loaded / evicted."""
        names = [m.name for m in models]
        if len(set(names)) != len(names):
            raise ValueError(f"models served by one worker need distinct directory names, got {names}")
        self.models = {m.name: m for m in models}
        self.default = models[0].name
        self.limits = limits
        self._load, self._unload, self._estimate = load, unload, estimate
        self.on_change = on_change
        self._lock = asyncio.Lock()  # one load or eviction decision at a time
        self._idle = asyncio.Event()  # set whenever a model's last request ends (room may have appeared)

    def names(self) -> list[str]:
        return list(self.models)

    def resident(self) -> list[str]:
        return [m.name for m in self.models.values() if m.resident is not None]

    def get(self, name: str) -> HostedModel:
        m = self.models.get(name or self.default)
        if m is None:
            raise RequestError(f"model {name!r} is not served by this worker (it serves {', '.join(self.models)})")
        return m

    async def acquire(self, name: str) -> HostedModel:
        """The model, resident and counted as in use until `release`: loaded first if need be."""
        m = self.get(name)
        deadline = time.monotonic() + self.limits.wait_s
        while m.resident is None or m.evicting:
            self._idle.clear()  # (before looking for room: a model going idle from here on wakes the wait below)
            async with self._lock:
                if m.resident is None:
                    victims = self._room_for(m)
                    if victims is not None:
                        for v in victims:  # (marked first: none of them takes a request while others go)
                            v.evicting = True
                        for v in victims:
                            await self._evict(v)
                        await self._load_one(m)
                        break
            if m.resident is not None and not m.evicting:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise ModelUnavailable(f"no room to load model {m.name!r} within {self.limits.wait_s:.0f}s: every "
                                       f"resident model is busy ({self._describe()})")
            try:
                await asyncio.wait_for(self._idle.wait(), left)
            except TimeoutError:
                pass
        m.active += 1
        m.last_used = time.monotonic()
        return m

    def release(self, m: HostedModel) -> None:
        m.active -= 1
        m.last_used = time.monotonic()
        if m.active == 0:
            self._idle.set()

    def _footprint(self, m: HostedModel) -> int:
        return m.footprint or self._estimate(m)

    def _room_for(self, m: HostedModel) -> list[HostedModel] | None:
        """The resident models to evict (idle ones, least recently used first) so that `m` fits; None
        when it cannot fit until a busy one goes idle."""
        need = self._footprint(m)
        budget, most = self.limits.memory_bytes, self.limits.max_loaded
        if budget and need > budget:
            raise ModelUnavailable(f"model {m.name!r} needs {need / 2**30:.2f} GiB (weights + KV cache), above "
                                   f"--model-memory-gb {budget / 2**30:.2f}")
        resident = [r for r in self.models.values() if r.resident is not None]
        used = sum(self._footprint(r) for r in resident)
        victims: list[HostedModel] = []
        for r in sorted((r for r in resident if r.active == 0 and not r.pinned), key=lambda r: r.last_used):
            if (not most or len(resident) - len(victims) < most) and (not budget or used + need <= budget):
                break
            victims.append(r)
            used -= self._footprint(r)
        if (most and len(resident) - len(victims) >= most) or (budget and used + need > budget):
            return None
        return victims

    async def _evict(self, m: HostedModel) -> None:
        t0 = time.perf_counter()
        try:
            await self._unload(m)
        finally:
            m.resident = None
            m.evicting = False
            self._idle.set()  # (a request waiting for this model loads it again)
        seconds = time.perf_counter() - t0
        log.info("event=model_evicted model=%s footprint_mib=%.0f seconds=%.3f", m.name, m.footprint / 2**20, seconds)
        if self.on_change is not None:
            self.on_change("evicted", m, seconds)

    async def _load_one(self, m: HostedModel) -> None:
        t0 = time.perf_counter()
        try:
            m.resident, m.footprint = await self._load(m)
        except Exception as e:  # (a corrupt checkpoint, no memory): this request fails, the others go on
            log.exception("event=model_load_failed model=%s path=%s", m.name, m.path)
            if self.on_change is not None:
                self.on_change("failed", m, time.perf_counter() - t0)
            raise ModelUnavailable(f"model {m.name!r} could not be loaded: {type(e).__name__}: {e}") from e
        m.loads += 1
        seconds = time.perf_counter() - t0
        log.info("event=model_loaded model=%s footprint_mib=%.0f seconds=%.3f loads=%d", m.name,
                 m.footprint / 2**20, seconds, m.loads)
        if self.on_change is not None:
            self.on_change("loaded", m, seconds)

    def _describe(self) -> str:
        return ", ".join(f"{r.name}: {r.active} requests" for r in self.models.values() if r.resident is not None)

    async def close(self) -> None:
        """Free every resident model but the pinned first (the worker stops that one itself)."""
        for m in self.models.values():
            if m.resident is not None and not m.pinned:
                await self._unload(m)
                m.resident = None
