"""One team of OpenMP threads per process: the engine thread's.

torch (and `engine/model/kernels/cpu_ops.c`) compute with libgomp, which keeps a pool of worker threads
for every thread that ever ran a parallel region, for the life of that thread. When the threads it
manages outnumber the CPUs the process may use, libgomp stops spinning at its barriers (a "throttled"
spin of ~100 iterations, then a futex sleep): every barrier of every layer then puts the team to sleep
and wakes it again. A worker loads its model on the main thread (one pool) and steps the engine on
another (a second pool), which is exactly that case: ~100 context switches per token for SmolLM2 at batch
1, against ~1 in process, and each token 1.3x slower served than in process
(`python -m loadtest.bench_served_itl`).

`release_pool()` ends the calling thread's pool (OpenMP 5's `omp_pause_resource_all`). The thread that
loaded the model calls it before the engine thread starts (`AsyncEngine.start`), an engine thread that
goes idle gives its own back (so a second engine — a model loaded on demand — computes alone), and a
helper thread that ran torch (an adapter read, a model loaded off the event loop) calls it when done
(`releasing`). Without libgomp (another OpenMP runtime, or none) these do nothing.

A team that spins has the opposite weakness: when something else keeps a core busy (another process
computing, a compiler, a noisy neighbour), a thread of the team is off its core for a scheduler slice
at a time while the others spin at the barrier waiting for it — SmolLM2's served step went from 9 ms to
over 500 ms beside one busy-looping process. `CoreShare` watches how much of the engine's cores other
processes take (/proc/stat against this process's own CPU time, every half second) and gives the
engine thread as many compute threads as there are cores left to it: fewer at once when a neighbour
takes a core, the full count again once they stayed free for a few seconds. One thread has no barrier
to wait at.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ParamSpec, TypeVar

log = logging.getLogger("splitfire.engine")

P = ParamSpec("P")
T = TypeVar("T")

OMP_PAUSE_SOFT = 1  # (omp_pause_resource_t: the pool's threads end; the ICVs are kept)


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp torch loaded (found in this process's mappings: wheels rename their copy), if it has
    `omp_pause_resource_all` (GCC 9+)."""
    import torch  # noqa: F401  (loads the OpenMP runtime it was built with)

    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/libgomp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        if not os.path.basename(path).startswith("libgomp"):
            continue
        lib = ctypes.CDLL(path)  # (already loaded: the same handle, nothing new mapped)
        if hasattr(lib, "omp_pause_resource_all"):
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            lib.omp_pause_resource_all.restype = ctypes.c_int
            return lib
    log.debug("event=omp_pool_release_unavailable reason=%s", "no libgomp with omp_pause_resource_all loaded")
    return None


def release_pool() -> bool:
    """End the OpenMP worker threads the calling thread started (the next parallel region it runs starts
    new ones). Whether libgomp did; False also outside libgomp or inside a parallel region."""
    lib = _libgomp()
    return lib is not None and lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0


def releasing(fn: Callable[P, T]) -> Callable[P, T]:
    """`fn`, followed (however it ends) by `release_pool()` on the thread that ran it: for work handed to
    a helper thread (`asyncio.to_thread`) that may compute with torch."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return fn(*args, **kwargs)
        finally:
            release_pool()

    return run


TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _busy_ticks(cores: frozenset[int]) -> int:
    """Ticks the given CPUs spent on anything (user, system, interrupts, and a hypervisor's steal)."""
    busy = 0
    with open("/proc/stat") as f:
        for line in f:
            if not line.startswith("cpu"):
                break  # (the per-CPU lines come first)
            if not line[3].isdigit():
                continue  # (the all-CPU total)
            name, *vals = line.split()
            if int(name[3:]) in cores:
                v = [int(x) for x in vals[:8]]  # user nice system idle iowait irq softirq steal
                busy += sum(v) - v[3] - v[4]
    return busy


def _own_ticks() -> int:
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


@dataclass
class CoreShare:
    """How many compute threads the engine thread should use: the cores other processes leave it.

    `update` is the decision (pure: readings in, a thread count out); `threads` reads /proc at most
    every `interval_s` and applies it. Fewer threads at once when others take a core (the spin at each
    barrier collapses then); more only after `raise_after_s` of the cores staying free."""

    cores: frozenset[int]
    max_threads: int
    interval_s: float = 0.5
    raise_after_s: float = 2.0
    current: int = 0
    foreign: float = 0.0  # cores' worth of CPU others took over the last interval
    _last: tuple[float, int, int] | None = None
    _higher_since: float | None = None
    _next_at: float = 0.0
    changes: list[tuple[float, int, float]] = field(default_factory=list)  # (when, threads, foreign)

    def __post_init__(self) -> None:
        if not self.current:
            self.current = self.max_threads

    def update(self, now: float, busy_ticks: int, own_ticks: int) -> int:
        if self._last is None:
            self._last = (now, busy_ticks, own_ticks)
            return self.current
        t0, b0, o0 = self._last
        self._last = (now, busy_ticks, own_ticks)
        dt = now - t0
        if dt <= 0 or dt > 2 * self.interval_s:
            # (the engine was idle since: whatever ran then says nothing about the cores it computes
            # beside now — a fresh window starts here)
            return self.current
        self.foreign = max(0.0, (busy_ticks - b0) - (own_ticks - o0)) * TICK_S / dt
        free = len(self.cores) - self.foreign
        want = max(1, min(self.max_threads, math.floor(free + 0.5)))
        if want < self.current:
            self._set(now, want)
        elif want > self.current:
            if self._higher_since is None:
                self._higher_since = now
            elif now - self._higher_since >= self.raise_after_s:
                self._set(now, want)
        else:
            self._higher_since = None
        return self.current

    def _set(self, now: float, n: int) -> None:
        self.current = n
        self._higher_since = None
        self.changes.append((now, n, self.foreign))
        del self.changes[:-32]

    def threads(self) -> int:
        """The count for the next step (on the engine thread, before it)."""
        now = time.monotonic()
        if now < self._next_at:
            return self.current
        self._next_at = now + self.interval_s
        return self.update(now, _busy_ticks(self.cores), _own_ticks())


ENGINE_THREAD = "sf-engine"  # the engine thread's OS name; the compute threads it starts inherit it


def _engine_switches() -> int:
    """Voluntary context switches of this process's engine thread and its compute threads."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != ENGINE_THREAD:
                    continue
            with open(f"/proc/self/task/{tid}/status") as f:
                n += sum(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
        except OSError:  # (ended since listed)
            pass
    return n


@dataclass
class TeamWatch:
    """Says so (once, in the log) when the engine's compute threads sleep at their barriers: a
    spinning team makes a few voluntary context switches per step, a throttled one ~100 (SmolLM2, batch
    1) — the sign that some other thread of the process holds a pool of OpenMP threads again."""

    per_step_limit: float = 30.0
    min_steps: int = 20
    interval_s: float = 2.0
    warned: bool = False
    _last: tuple[int, int] | None = None  # (steps, switches) at the last sample
    _next_at: float = 0.0

    def update(self, steps: int, switches: int) -> float | None:
        """Switches per step since the last sample that had at least `min_steps` steps (None: too few
        yet); the first over the limit is logged."""
        if self._last is None or steps < self._last[0]:
            self._last = (steps, switches)
            return None
        ds = steps - self._last[0]
        if ds < self.min_steps:
            return None
        rate = (switches - self._last[1]) / ds
        self._last = (steps, switches)
        if rate > self.per_step_limit and not self.warned:
            self.warned = True
            log.warning("event=compute_threads_sleeping switches_per_step=%.0f: the compute threads sleep at "
                        "their barriers (libgomp throttles when another thread of this process keeps a pool of "
                        "OpenMP threads: something ran torch off the engine thread without releasing it; see "
                        "engine/compute_threads.py)", rate)
        return rate

    def sample(self, steps: int) -> float | None:
        """On the engine thread, after a step: reads /proc at most every `interval_s`."""
        now = time.monotonic()
        if now < self._next_at:
            return None
        self._next_at = now + self.interval_s
        return self.update(steps, _engine_switches())
