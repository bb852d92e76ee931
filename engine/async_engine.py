"""Runs an `LLMEngine` on its own thread and bridges it to asyncio.

The engine thread owns the engine: every change (add, abort, reserve, activate) is a
command it runs between steps, so the engine needs no locks. Outputs of a step are
handed to the event loop in one call; each request's stream merges whatever piled up
since its reader last looked, so a slow reader costs one bigger message, never a
stalled decode loop.
"""

from __future__ import annotations

import asyncio
import ctypes
import heapq
import itertools
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from common.sampling_params import SamplingParams
from engine.batch.sequence import Mode, Sequence, TokenLogprob
from engine.compute_threads import ENGINE_THREAD, CoreShare, TeamWatch, release_pool
from engine.llm_engine import LLMEngine
from engine.outputs import EngineStats, RequestOutput, StepObserver

log = logging.getLogger("splitfire.engine")
T = TypeVar("T")


class RequestStream:
    """Outputs of one request, merged while unread.

    `sink` (optional) takes an output synchronously, on the event loop as the step's outputs are handed
    out: True when it has dealt with it in full (the decode worker's direct path writes a plain token's
    frame at once), False to leave it to the reader. It is offered an output only while the reader waits
    in `next` with nothing pending, so outputs are handled in their order either way."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._pending: RequestOutput | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.finished = False
        self.sink: Callable[[RequestOutput], bool] | None = None

    def push(self, out: RequestOutput) -> None:
        w = self._waiter
        waiting = w is not None and not w.done()  # (then nothing is pending: an output wakes it)
        if waiting and self.sink is not None and self.sink(out):
            return
        if self._pending is None:
            self._pending = out
        else:
            self._pending.merge(out)
        if waiting:
            w.set_result(None)  # type: ignore[union-attr]

    async def next(self) -> RequestOutput | None:
        """Everything produced since the last call; None once the request is over."""
        if self.finished:
            return None
        while self._pending is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        out, self._pending = self._pending, None
        self.finished = out.finished
        return out

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        out = await self.next()
        if out is None:
            raise StopAsyncIteration
        return out


class AsyncEngine:
    def __init__(self, llm: LLMEngine, observer: StepObserver | None = None):
        self.llm = llm
        self.observer = observer
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._timers: list[tuple[float, int, Callable[[LLMEngine], Any]]] = []  # engine-thread only
        self._seq = itertools.count()
        self._streams: dict[str, RequestStream] = {}
        self._held: dict[str, Sequence] = {}  # quarantined requests' sequences (engine thread)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.step_count = 0
        # What the engine looked like after its last step or command: read by Stats without
        # queueing behind a long step (a busy worker must still answer the router's checks).
        self.stats: EngineStats = llm.stats()
        self._stats_at = 0.0
        self.on_step: Callable[[list[RequestOutput], float, int], None] | None = None  # metrics hook (loop thread)
        # Blocks the engine pinned for the cluster-wide KV tier (loop thread; see worker/kv/tier.py).
        self.on_publish: Callable[[list[tuple[list[bytes], list[int]]]], None] | None = None
        # Requests admitted to be filled from the KV tier before computing (loop thread).
        self.on_fetch: Callable[[list[str]], None] | None = None
        # The prefix cache's KV events (last event number, events) after each step (loop thread; set before start()).
        self.on_kv_events: Callable[[int, bytes], None] | None = None

    def start(self) -> None:
        if self.on_kv_events is not None:
            self.llm.blocks.enable_kv_events()
        self._loop = asyncio.get_running_loop()
        # From here the engine thread computes; the OpenMP threads of whoever loaded the model (this
        # thread, as a rule) would make libgomp sleep at every barrier (engine/compute_threads.py).
        release_pool()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)
        self.llm.close()

    # -- commands (called from the event loop) ----------------------------------------

    def call(self, fn: Callable[[LLMEngine], T]) -> asyncio.Future[T]:
        """Run `fn(engine)` on the engine thread between steps; its result or exception comes back."""
        assert self._loop is not None, "start() first"
        loop = self._loop
        fut: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                res = fn(self.llm)
            except BaseException as e:  # handed to the awaiting caller, which decides
                loop.call_soon_threadsafe(_settle, fut, None, e)
            else:
                loop.call_soon_threadsafe(_settle, fut, res, None)

        self._commands.put(run)
        self._wake.set()
        return fut

    def call_and_deliver(self, fn: Callable[[LLMEngine], list[RequestOutput]]) -> asyncio.Future[None]:
        """Like `call`, for commands that produce outputs (e.g. activating a prefilled request):
        the outputs reach their streams before anything a later step produces."""
        assert self._loop is not None, "start() first"
        loop = self._loop

        def wrapped(engine: LLMEngine) -> None:
            outputs = fn(engine)
            loop.call_soon_threadsafe(self.deliver, outputs)

        return self.call(wrapped)

    def abort(self, request_id: str) -> asyncio.Future[None]:
        """Abort a request; its stream (if open) ends with finish_reason "abort"."""

        def run(engine: LLMEngine) -> list[RequestOutput]:
            if engine.abort(request_id):
                return [RequestOutput(request_id, finished=True, finish_reason="abort")]
            return []

        return self.call_and_deliver(run)

    # -- typed commands: what the serving shell asks of the engine ------------------------

    @property
    def block_size(self) -> int:
        return self.llm.config.block_size

    def add_request(self, request_id: str, ids: list[int], sampling: SamplingParams, tenant: str,
                    mode: Mode = Mode.FULL, fetch: bool = False, weight: float = 1.0, adapter: str = "",
                    priority: int = 0) -> asyncio.Future[None]:
        """Queue a prompt (see `LLMEngine.add_request`). An `abort` sent after this call, even
        before it completes, runs after it: a request cancelled while queued is never computed."""

        def run(engine: LLMEngine) -> None:
            engine.add_request(request_id, ids, sampling, tenant, mode, fetch=fetch, weight=weight, adapter=adapter,
                               priority=priority)

        return self.call(run)

    def reserve(self, request_id: str, ids: list[int], sampling: SamplingParams, tenant: str, weight: float = 1.0,
                adapter: str = "", priority: int = 0) -> asyncio.Future[tuple[int, list[int]] | None]:
        """Blocks for a prompt another process fills: (tokens already cached here, block ids), or
        None when there are no free blocks now."""

        def run(engine: LLMEngine) -> tuple[int, list[int]] | None:
            seq = engine.handoff.reserve(request_id, ids, sampling, tenant, weight=weight, adapter=adapter,
                                         priority=priority)
            return None if seq is None else (seq.num_cached_tokens, list(seq.block_table))

        return self.call(run)

    def take_landing(self, request_id: str, first_block: int) -> asyncio.Future[list[int] | None]:
        """`Handoff.take_landing`."""
        return self.call(lambda e: e.handoff.take_landing(request_id, first_block))

    def activate(self, request_id: str, first_token: int, logprob: TokenLogprob | None,
                 cached_tokens: int, landed: list[tuple[int, int, int]] | None = None) -> asyncio.Future[None]:
        """A reserved prompt's K/V have landed: decode from `first_token` (delivered in order)."""
        return self.call_and_deliver(lambda e: [e.handoff.activate(request_id, first_token, logprob, cached_tokens,
                                                           landed)])

    def start_local_prefill(self, request_id: str) -> asyncio.Future[None]:
        return self.call(lambda e: e.handoff.start_local_prefill(request_id))

    def cached_prefix_blocks(self, hashes: list[bytes]) -> asyncio.Future[int]:
        """How many leading blocks of `hashes` this engine's prefix cache holds."""
        return self.call(lambda e: len(e.blocks.match_prefix(hashes)))

    def fill_plan(self, request_id: str) -> asyncio.Future[tuple[list[bytes], list[int]]]:
        return self.call(lambda e: e.handoff.fill_plan(request_id))

    def mark_filled(self, request_id: str, num_blocks: int) -> asyncio.Future[int]:
        return self.call(lambda e: e.handoff.mark_filled(request_id, num_blocks))

    def resume_after_fill(self, request_id: str) -> asyncio.Future[None]:
        return self.call(lambda e: e.handoff.resume_after_fill(request_id))

    def reset_prefix_cache(self) -> asyncio.Future[tuple[int, int]]:
        return self.call(lambda e: e.blocks.reset_prefix_cache())

    def unpin_published(self, blocks: list[int]) -> asyncio.Future[None]:
        return self.call(lambda e: e.handoff.unpin_published(blocks))

    def quarantine(self, request_id: str, delay_s: float) -> None:
        """Stop a request now but free its blocks only after `delay_s`: a failed or cancelled
        transfer may still land writes in them (Mooncake keeps writing after a failed call).
        `release_held` frees them sooner, on proof that nothing can land any more."""

        def hold(engine: LLMEngine) -> None:
            seq = engine.handoff.hold(request_id)
            if seq is not None:
                self._held[request_id] = seq
                heapq.heappush(self._timers, (time.monotonic() + delay_s, next(self._seq),
                                              lambda e: self._release_held(request_id, seq)))

        self._commands.put(lambda: hold(self.llm))
        self._wake.set()

    def release_held(self, request_id: str) -> None:
        """Free a quarantined request's blocks now (the writer proved no write can still land)."""
        self._commands.put(lambda: self._release_held(request_id, None))
        self._wake.set()

    def _release_held(self, request_id: str, seq: Sequence | None) -> None:
        held = self._held.get(request_id)
        if held is None or (seq is not None and held is not seq):
            return  # already released (early, or a newer request reused the id)
        del self._held[request_id]
        self.llm.handoff.release(held)

    def open_stream(self, request_id: str) -> RequestStream:
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        return stream

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Route outputs to their streams (event-loop thread)."""
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.push(out)
                if out.finished:
                    self._streams.pop(out.request_id, None)

    # -- engine thread ----------------------------------------------------------------

    def _run_due_timers(self) -> tuple[float | None, bool]:
        """(seconds to the next timer or None, whether any ran)."""
        now = time.monotonic()
        ran = False
        while self._timers and self._timers[0][0] <= now:
            _, _, fn = heapq.heappop(self._timers)
            ran = True
            try:
                fn(self.llm)
            except Exception:
                log.exception("event=timer_failed")
        return (self._timers[0][0] - now if self._timers else None), ran

    def _refresh_stats(self) -> None:
        self.stats, self._stats_at = self.llm.stats(), time.monotonic()

    def _run(self) -> None:
        assert self._loop is not None
        loop = self._loop
        _name_os_thread(ENGINE_THREAD)
        busy = False  # stepped since it last went idle
        share, watch = self._thread_keepers()
        while not self._stopping:
            ran = False
            while True:
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    break
                cmd()
                ran = True
            next_timer, timers_ran = self._run_due_timers()
            if ran or timers_ran:
                self._refresh_stats()
                self._hand_out_published()
            if not self.llm.has_work:
                if busy:  # idle from now: its OpenMP threads back, so another engine computes alone
                    busy = False
                    release_pool()
                self._wake.wait(timeout=next_timer if next_timer is not None else 1.0)
                self._wake.clear()
                continue
            if share is not None and share.threads() != torch.get_num_threads():
                torch.set_num_threads(share.current)
                log.info("event=compute_threads threads=%d of=%d cores=%d foreign_cores=%.2f", share.current,
                         share.max_threads, len(share.cores), share.foreign)
            t0 = time.perf_counter()
            busy = True
            try:
                outputs = self.llm.step(self.observer)
            except Exception as e:
                log.exception("event=step_failed running=%d", len(self.llm.scheduler.running))
                outputs = self._fail_all(f"engine step failed: {type(e).__name__}: {e}")
            self.step_count += 1
            if watch is not None:
                watch.sample(self.step_count)
            self._hand_out_published()
            # O(sequences) to compute (~0.1 ms at 256 running): at most every 10 ms while busy.
            if time.monotonic() - self._stats_at >= 0.01 or not self.llm.has_work:
                self._refresh_stats()
            if outputs or self.on_step is not None:
                dt = time.perf_counter() - t0
                loop.call_soon_threadsafe(self._after_step, outputs, dt)

    def _thread_keepers(self) -> tuple[CoreShare | None, TeamWatch | None]:
        """Serving on CPU with a team of compute threads: a watch on whether it sleeps at its barriers,
        and (unless --fixed-threads) as many threads as the cores other processes leave."""
        n = torch.get_num_threads()
        if self.llm.device.type != "cpu" or self.llm.ranks is not None or n < 2:
            return None, None
        share = CoreShare(frozenset(os.sched_getaffinity(0)), n) if self.llm.config.adaptive_threads else None
        return share, TeamWatch()

    def kv_snapshot(self) -> asyncio.Future[tuple[int, list[bytes]]]:
        return self.call(lambda e: e.blocks.kv_snapshot())

    def _hand_out_published(self) -> None:
        if self.llm.blocks.kv_events and self.on_kv_events is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self.on_kv_events, *self.llm.blocks.take_kv_events())
        if self.llm.handoff.to_publish and self.on_publish is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self.on_publish, self.llm.handoff.take_published())
        if self.llm.scheduler.admitted_for_fetch and self.on_fetch is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self.on_fetch, self.llm.handoff.take_fetches())

    def _after_step(self, outputs: list[RequestOutput], step_s: float) -> None:
        # (Loop thread.) Torch work the serving shell did here (staging, a copy) may have left a pool of
        # OpenMP threads on this thread: back at once, so the engine's team stays the only one.
        release_pool()
        self.deliver(outputs)
        if self.on_step is not None:
            self.on_step(outputs, step_s, len(self.llm.scheduler.running))

    def _fail_all(self, message: str) -> list[RequestOutput]:
        outs = []
        for rid in list(self.llm.seqs):
            self.llm.abort(rid)
            outs.append(RequestOutput(rid, finished=True, finish_reason="error", error=message))
        return outs


def _name_os_thread(name: str) -> None:
    """Name the calling thread for the OS (/proc/<pid>/task/<tid>/comm): top, py-spy and
    `loadtest/bench_host.py` tell the engine thread's CPU from the serving threads' by it."""
    if sys.platform != "linux":
        return  # (only the name is lost)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def _settle(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
