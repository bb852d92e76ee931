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
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable
from typing import ParamSpec, TypeVar

log = logging.getLogger(__name__)

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
