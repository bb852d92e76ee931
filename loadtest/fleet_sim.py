"""A discrete-event simulation of a whole fleet serving a Mooncake trace (`../shared/data/mooncake_traces/`):
the full hour, real arrivals and lengths, real prefix sharing (the trace's 512-token block hashes).

Placement is the router's own code: `router.placement.balancer` policies over `router.core.endpoints.Endpoint` load
estimates (charged and released as the router does) and `router.core.prefix_index.PrefixIndex` for the
expected cache hit. Workers are a cost model (`CostModel`):

- **prefill worker**: FIFO; a prompt takes `overhead + uncached / prefill_tps` (blocks fetched from the
  cluster KV store cost `store_fetch_cost` of computing them); its prefix cache is an LRU of trace
  blocks (`cache_blocks` per worker); the KV store, when on, an LRU shared by the fleet.
- **decode worker**: continuous batching, at most `max_batch` streams; a step takes the measured
  step time at that batch (interpolated) plus reading the batch's extra context beyond the profiled one
  at `kv_bytes_per_token / kv_bandwidth`. Between events the batch is constant, so every stream
  advances by elapsed / step tokens at once (events are arrivals, prefills and completions — not
  steps: the hour simulates in seconds).
- **colocated worker** (`--layout colocated`): both, in one step loop: a step carries up to
  `chunk_tokens` of queued prompts beside the decodes and lasts decode step + chunk / prefill_tps —
  the interference disaggregation removes.

A request meets its SLO when its TTFT <= `--ttft-slo` and its mean inter-token time <= `--itl-slo`.
`itl_p50/p90_ms` are over requests' mean inter-token times; `token_itl_p90/p99_ms` over every generated
token's (a colocated step carrying a prompt chunk is a long gap for every stream in it).

`--compare-planner` sizes the fleet three ways over the trace and writes
`{"planner": {"slo_attainment", "worker_hours", ...}, "best_static": {...}, "cpu_hpa": {...}}`:
`planner.decision.Planner` every `--interval` seconds on the interval's metrics (new workers ready
after `--startup` seconds, drained ones leave when empty); every static prefill:decode split up to
`--max-workers`, the best chosen in hindsight (the fewest worker-hours with attainment at least the
planner's, else the best attainment); and a CPU-utilization HPA per role (target 70%, 10% tolerance,
5-minute scale-down stabilization, as Kubernetes' defaults), where a worker's utilization is the time
it is busy — which a decode worker is whenever it holds a stream. `--start steady` (the default) gives the
planner and the HPA the fleet, and the planner the learned state, of one earlier pass over the trace (what
`--state` keeps across restarts: a planner in production has run before the hour measured, and on a day's
trace has seen a day);
`--clairvoyant` adds what hindsight could do with autoscaling (`clairvoyant`: a per-interval schedule
with no start-up, searched greedily to the best static split's attainment).

    python -m loadtest.fleet_sim --trace ../shared/data/mooncake_traces/conversation_trace.jsonl \\
        --prefill 4 --decode 4 --policy token --store
    python -m loadtest.fleet_sim --trace FILE --compare-planner --json OUT.json --plot OUT.png
    python -m loadtest.fleet_sim --trace FILE --layout colocated --workers 8     # vs --prefill 4 --decode 4

Calibration (`COST_MODELS`): `h200-llama3-8b` from this project's own H200 run (`loadtest/bench_gpu`,
2026-11-26: decode step 5.87 / 6.64 / 7.87 / 12.22 ms at batch 1 / 8 / 32 / 128 with 1,024 tokens of
context each, prefill 37,223 tokens/s at 2,048 tokens; `loadtest/results/gpu-decode/h200/bench_gpu_llama3.txt`).
What it leaves out: attention cost growing with a prompt's length in prefill (its tokens/s is the
2k-token figure), preemption, network time other than `transfer_s_per_token`, failures.

Validation against a live run (`--compare-live REPLAY.json --cost-model-json WORKER.json`): the
requests a `loadtest/trace_replay.py --json` run sent (its `--block`, `--speed`, `--max-output`: the
simulated requests are the same token counts and arrivals, `scaled`), on workers measured on the same
machine in process (`loadtest/cpu_cost_model.py`: whole-prompt prefill times at several lengths, so a
prompt's tail costs prefill_s(n) - prefill_s(cached), and decode steps by batch), side by side with
what the live run measured. What it cannot see there: several processes sharing a few cores (the
router, the client and the KV transfer's threads take cycles from the workers' compute).
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import json
import math
import statistics
import sys
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from pathlib import Path

from loadtest.trace_replay import TRACE_BLOCK, Scale, TraceRequest, leading_cached, read_trace
from loadtest.workload import pct as workload_pct
from planner.decision import Limits, Planner, Profile, Snapshot
from planner.metrics import prompt_peaks
from router.core.endpoints import Endpoint
from router.core.prefix_index import PrefixIndex
from router.placement.balancer import Placement, make_policy


@dataclass(frozen=True)
class CostModel:
    prefill_tps: float  # prompt tokens/s one prefill worker computes
    decode_step_s: dict[int, float]  # batch -> seconds per decode step at `profiled_context` tokens each
    profiled_context: int
    kv_bytes_per_token: float
    kv_bandwidth: float  # bytes/s a decode step reads the KV cache at
    prefill_overhead_s: float = 0.005
    max_batch: int = 256
    kv_tokens: int = 2_000_000  # KV cache per worker, tokens (decode admission)
    cache_blocks: int = 2_000  # prefix cache per worker, in trace blocks (512 tokens)
    store_blocks: int = 200_000  # cluster KV store, trace blocks
    store_fetch_cost: float = 0.2  # a block fetched from the store costs this share of computing it
    transfer_s_per_token: float = 2e-7  # prefill -> decode KV transfer
    chunk_tokens: int = 2048  # colocated: prompt tokens a step may carry beside its decodes
    # Measured seconds to prefill a whole prompt of n tokens (`cpu_cost_model.py`); when set, computing tokens
    # [c, n) of a prompt costs prefill_s(n) - prefill_s(c), attention over the cached part included.
    prefill_s: dict[int, float] | None = None

    def prefill_time(self, total: int, cached: int) -> float:
        """Seconds to compute a prompt's tokens [cached, total)."""
        if self.prefill_s is None:
            return (total - cached) / self.prefill_tps
        return self._curve(total) - self._curve(cached)

    def _curve(self, n: float) -> float:
        pts = sorted(self.prefill_s.items()) if self.prefill_s else []
        xs = [0.0] + [float(x) for x, _ in pts]
        ys = [0.0] + [y for _, y in pts]
        i = min(max(bisect.bisect_left(xs, n), 1), len(xs) - 1)  # the segment holding n (or the last one)
        return ys[i - 1] + (ys[i] - ys[i - 1]) * (n - xs[i - 1]) / (xs[i] - xs[i - 1])

    def step_s(self, batch: int, context_tokens: float) -> float:
        """One decode step of `batch` streams holding `context_tokens` in all."""
        sizes = sorted(self.decode_step_s)
        i = bisect.bisect_left(sizes, batch)
        if i == 0:
            base = self.decode_step_s[sizes[0]]
        elif i == len(sizes):  # beyond the largest measured batch: linear in the last segment's slope
            a, b = sizes[-2], sizes[-1]
            slope = (self.decode_step_s[b] - self.decode_step_s[a]) / (b - a)
            base = self.decode_step_s[b] + slope * (batch - b)
        else:
            a, b = sizes[i - 1], sizes[i]
            base = self.decode_step_s[a] + (self.decode_step_s[b] - self.decode_step_s[a]) * (batch - a) / (b - a)
        extra = max(context_tokens - batch * self.profiled_context, 0.0)
        return base + extra * self.kv_bytes_per_token / self.kv_bandwidth

    @classmethod
    def from_measured(cls, m: dict, store_blocks: int) -> CostModel:
        """From `loadtest/cpu_cost_model.py`'s JSON: one worker measured in process on this machine; its KV
        cache's blocks are both its prefix cache and its admission limit (run with `--block` equal to the
        engine's block size, so that a trace block is one cache block)."""
        return cls(prefill_tps=float(m["prefill_tps"]),
                   decode_step_s={int(b): float(t) for b, t in m["decode_step_s"].items()},
                   profiled_context=int(m["profiled_context"]), kv_bytes_per_token=float(m["kv_bytes_per_token"]),
                   kv_bandwidth=float(m.get("kv_bandwidth", 10e9)), max_batch=int(m.get("max_batch", 256)),
                   kv_tokens=int(m["kv_blocks"]) * int(m["block_size"]), cache_blocks=int(m["kv_blocks"]),
                   store_blocks=store_blocks, transfer_s_per_token=float(m.get("transfer_s_per_token", 2e-7)),
                   prefill_s={int(n): float(t) for n, t in m["prefill_s"].items()} if "prefill_s" in m else None)

    def profile(self) -> Profile:
        """The planner's view of one worker (what `splitfire planner profile` would measure)."""
        batches = [b for b in (1, 8, 32, 64, 128, 256) if b <= self.max_batch]
        return Profile(self.prefill_tps, {b: self.step_s(b, b * self.profiled_context) for b in batches},
                       profiled_context=self.profiled_context, kv_s_per_token=self.kv_bytes_per_token / self.kv_bandwidth,
                       kv_tokens=self.kv_tokens, prefill_overhead_s=self.prefill_overhead_s)


COST_MODELS = {
    # Llama-3-8B shape in bfloat16 on one H200 (measured here; see the module docstring). KV: 32 layers x 2 x
    # 8 heads x 128 x 2 bytes; the step's extra context read at 60% of the 4.2 TB/s copy bandwidth measured.
    "h200-llama3-8b": CostModel(prefill_tps=37_223.0, decode_step_s={1: 5.87e-3, 8: 6.64e-3, 32: 7.87e-3, 128: 12.22e-3},
                                profiled_context=1024, kv_bytes_per_token=131_072.0, kv_bandwidth=0.6 * 4.22e12,
                                kv_tokens=800_000, cache_blocks=1_500),
}


# -- the simulated fleet ------------------------------------------------------------------------


@dataclass(eq=False)
class Stream:
    req: int
    remaining: float  # decode tokens still to produce when admitted
    context: float
    started: float
    first_token_at: float


@dataclass(eq=False)
class SimWorker:
    ep: Endpoint
    role: str
    cache: OrderedDict[int, None] = field(default_factory=OrderedDict)
    queue: list[int] = field(default_factory=list)  # prefill: request ids waiting (FIFO)
    busy_until: float = 0.0
    # decode: the running streams, a heap on the `progress` at which each ends (every running stream produces the
    # same tokens per step, so one counter advances them all: an event costs log(batch), not batch)
    streams: list[tuple[float, int, Stream]] = field(default_factory=list)
    progress: float = 0.0  # tokens each running stream has produced since the worker started
    held: float = 0.0  # KV context of the running streams, tokens
    waiting: list[Stream] = field(default_factory=list)  # decode: admitted when room
    step: float = 0.0  # current decode step time
    last: float = 0.0  # when streams last advanced
    version: int = 0  # invalidates scheduled decode events
    busy_s: float = 0.0
    ready_at: float = 0.0
    draining: bool = False
    added_at: float = 0.0
    removed_at: float | None = None
    chunk_left: float = 0.0  # colocated: prompt tokens of the running prefill still to compute
    current: int | None = None  # colocated: the request whose prompt is being computed
    current_computed: int = 0


@dataclass
class Outcome:
    at: float
    ttft: float = math.nan
    itl: float = math.nan
    done_at: float = math.nan
    cached_blocks: int = 0
    prompt_blocks: int = 0


class Fleet:
    def __init__(self, reqs: list[TraceRequest], model: CostModel, *, prefill: int, decode: int, layout: str,
                 policy: str, store: bool, ttft_slo: float, itl_slo: float, block_tokens: int = TRACE_BLOCK):
        self.reqs, self.m, self.layout = reqs, model, layout
        self.block = block_tokens  # tokens per trace block (a scaled replay's, see `scaled`)
        self.policy = make_policy(policy)
        self.index = PrefixIndex(model.cache_blocks, shared_store=store)
        self.store: OrderedDict[int, None] | None = OrderedDict() if store else None
        self.ttft_slo, self.itl_slo = ttft_slo, itl_slo
        self.events: list[tuple[float, int, str, object]] = []
        self.seq = itertools.count()
        self.now = 0.0
        self.workers: list[SimWorker] = []
        self.out = [Outcome(r.at_s, prompt_blocks=len(r.hash_ids)) for r in reqs]
        self.pending: dict[int, SimWorker] = {}  # request -> its decode worker (disaggregated)
        self.ids = itertools.count()
        self.token_itl: list[tuple[float, float]] = []  # (step seconds, tokens produced at it): every token's ITL
        # in the order they happened, for a scaler's interval metrics: (first token at, request), (done at, request)
        self.firsts: list[tuple[float, int]] = []
        self.dones: list[tuple[float, int]] = []
        self.arrivals = sorted((r.at_s, i) for i, r in enumerate(reqs))  # (arrival, request), for a scaler
        self.misses = 0  # requests known to miss an SLO so far
        self.give_up_after: int | None = None  # `run` stops once more requests than this miss (a hopeless split)
        if layout == "colocated":
            for _ in range(prefill + decode):
                self.add("colocated", 0.0)
        else:
            for _ in range(prefill):
                self.add("prefill", 0.0)
            for _ in range(decode):
                self.add("decode", 0.0)

    # -- workers ---------------------------------------------------------------------------

    def add(self, role: str, ready_at: float) -> SimWorker:
        w = SimWorker(Endpoint(f"{role}-{next(self.ids)}", role), role, ready_at=ready_at, added_at=self.now,
                      last=self.now)
        self.workers.append(w)
        return w

    def live(self, role: str) -> list[SimWorker]:
        return [w for w in self.workers if w.role == role and w.removed_at is None]

    def placeable(self, role: str) -> list[SimWorker]:
        return [w for w in self.live(role) if not w.draining and w.ready_at <= self.now]

    def drain(self, role: str) -> None:
        """The newest ready worker stops taking requests; it leaves once empty."""
        cands = self.placeable(role)
        if len(cands) > 1 or (role == "prefill" and cands):
            w = max(cands, key=lambda w: w.added_at)
            w.draining = True
            self._maybe_remove(w)

    def _maybe_remove(self, w: SimWorker) -> None:
        if w.draining and not w.queue and not w.streams and not w.waiting and w.busy_until <= self.now \
                and not any(d is w for d in self.pending.values()):
            w.removed_at = self.now

    # -- the event loop --------------------------------------------------------------------

    def push(self, t: float, kind: str, data: object) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, data))

    def run(self, until: float | None = None, tick: float | None = None, on_tick=None) -> None:
        for i, r in enumerate(self.reqs):
            self.push(r.at_s, "arrive", i)
        if tick is not None:
            self.push(tick, "tick", None)
        while self.events:
            if self.give_up_after is not None and self.misses > self.give_up_after:
                return
            t, _, kind, data = heapq.heappop(self.events)
            if until is not None and t > until:
                break
            self.now = t
            if kind == "arrive":
                self.arrive(data)  # type: ignore[arg-type]
            elif kind == "prefilled":
                self.prefilled(*data)  # type: ignore[misc]
            elif kind == "decode":
                w, version = data  # type: ignore[misc]
                if w.version == version:
                    self.advance(w)
            elif kind == "tick":
                assert on_tick is not None and tick is not None
                on_tick(self)
                if self.events:  # (until the trace is served: the tick was the only one of its kind)
                    self.push(t + tick, "tick", None)

    # -- placement (the router's code) -----------------------------------------------------

    def _hashes(self, i: int) -> list[bytes]:
        return [h.to_bytes(8, "little") for h in self.reqs[i].hash_ids]

    def arrive(self, i: int) -> None:
        r = self.reqs[i]
        hashes = self._hashes(i)
        max_blocks = max(len(hashes) - 1, 0)
        placement = Placement(r.input_length, lambda ep: self.index.cached_tokens(ep.address, hashes, max_blocks,
                                                                                  self.block))
        if self.layout == "colocated":
            ws = self.placeable("colocated") or self.live("colocated")
            by_ep = {w.ep.address: w for w in ws}
            dw = by_ep[self.policy.pick([w.ep for w in ws], placement).address]
            pw = dw
        else:
            ds = self.placeable("decode") or self.live("decode")
            ps = self.placeable("prefill") or self.live("prefill")
            by_ep = {w.ep.address: w for w in ds + ps}
            d, p = self.policy.pick_route([w.ep for w in ds], [w.ep for w in ps], placement)
            dw = by_ep[d.address]
            pw = by_ep[p.address] if p is not None else dw
        self.index.insert(pw.ep.address, hashes)
        cached, _ = self._cached(pw, r)
        uncached = max(r.input_length - cached * self.block, 1)
        pw.ep.charge(uncached, 0, 0, 1)
        dw.ep.charge(0, r.input_length, r.output_length, 0 if dw is pw else 1)
        self.out[i].cached_blocks = cached
        self.pending[i] = dw
        if pw.role == "colocated":
            pw.queue.append(i)
            self.advance(pw)
        else:
            pw.queue.append(i)
            self._prefill_next(pw)

    def _cached(self, w: SimWorker, r: TraceRequest) -> tuple[int, int]:
        """(blocks of `r`'s prompt `w` will not compute, of which fetched from the store): its own cache, then
        the store, at most all but the last."""
        n = 0
        limit = max(min(len(r.hash_ids) - 1, (r.input_length - 1) // self.block), 0)
        while n < limit and r.hash_ids[n] in w.cache:
            n += 1
        local = n
        if self.store is not None:
            while n < limit and r.hash_ids[n] in self.store:
                n += 1
        return n, n - local

    def _remember(self, w: SimWorker, r: TraceRequest) -> None:
        for cache, cap in ((w.cache, self.m.cache_blocks), (self.store, self.m.store_blocks)):
            if cache is None:
                continue
            for h in r.hash_ids:
                if h in cache:
                    cache.move_to_end(h)
                else:
                    cache[h] = None
            while len(cache) > cap:
                cache.popitem(last=False)

    def _prefill_time(self, w: SimWorker, r: TraceRequest) -> tuple[float, int]:
        cached, fetched = self._cached(w, r)
        computed = max(r.input_length - cached * self.block, 1)
        t = (self.m.prefill_overhead_s + self.m.prefill_time(r.input_length, r.input_length - computed)
             + fetched * self.block * self.m.store_fetch_cost / self.m.prefill_tps)
        return t, computed

    # -- prefill workers -------------------------------------------------------------------

    def _prefill_next(self, w: SimWorker) -> None:
        if w.busy_until > self.now or not w.queue:
            return
        i = w.queue.pop(0)
        t, computed = self._prefill_time(w, self.reqs[i])
        self._remember(w, self.reqs[i])
        w.busy_until = self.now + t
        w.busy_s += t
        self.push(w.busy_until, "prefilled", (w, i, computed))

    def prefilled(self, w: SimWorker, i: int, computed: int) -> None:
        r = self.reqs[i]
        w.ep.charge(-computed, 0, 0, -1)
        first = self.now + computed * self.m.transfer_s_per_token
        self.out[i].ttft = first - r.at_s
        self.firsts.append((first, i))
        if self.out[i].ttft > self.ttft_slo:
            self.misses += 1
        dw = self.pending.pop(i)
        if w.role == "colocated":
            self.advance(w)
        else:
            self._prefill_next(w)
            self._maybe_remove(w)
        if r.output_length <= 1:
            self._finish(dw, i, first, 0.0)
            return
        self._join(dw, Stream(i, r.output_length - 1, r.input_length + r.output_length / 2, first, first))

    # -- decode (and colocated) workers ----------------------------------------------------

    def _join(self, w: SimWorker, s: Stream) -> None:
        self.advance(w)
        w.waiting.append(s)
        self._admit(w)
        self._schedule(w)

    def _admit(self, w: SimWorker) -> None:
        while w.waiting and len(w.streams) < self.m.max_batch and w.held + w.waiting[0].context <= self.m.kv_tokens:
            s = w.waiting.pop(0)
            s.started = self.now
            w.held += s.context
            heapq.heappush(w.streams, (w.progress + s.remaining, s.req, s))

    def advance(self, w: SimWorker) -> None:
        """Every stream of `w` progresses by the time since the last event; finished ones leave."""
        dt = self.now - w.last
        w.last = self.now
        if w.streams and w.step > 0 and dt > 0:
            w.busy_s += dt
            tokens = dt / w.step
            self.token_itl.append((w.step, tokens * len(w.streams)))
            w.progress += tokens
            if w.role == "colocated" and w.chunk_left > 0:
                w.chunk_left -= tokens * self.m.chunk_tokens
                if w.chunk_left < 1e-6:
                    w.chunk_left = 0.0
        while w.streams and w.streams[0][0] - w.progress <= 1e-6:
            s = heapq.heappop(w.streams)[2]
            w.held -= s.context
            r = self.reqs[s.req]
            span = self.now - s.first_token_at
            self._finish(w, s.req, self.now, span / max(r.output_length - 1, 1))
        if w.role == "colocated":
            self._colocated_prefills(w)
        self._admit(w)
        self._schedule(w)
        self._maybe_remove(w)

    def _finish(self, w: SimWorker, i: int, at: float, itl: float) -> None:
        r = self.reqs[i]
        self.out[i].itl, self.out[i].done_at = itl, at
        self.dones.append((at, i))
        if itl > self.itl_slo and self.out[i].ttft <= self.ttft_slo:
            self.misses += 1
        w.ep.charge(0, -r.input_length, -r.output_length, -1)

    def _schedule(self, w: SimWorker) -> None:
        w.version += 1
        if not w.streams:
            w.step = 0.0
            return
        w.step = self.m.step_s(len(w.streams), w.held)
        steps = w.streams[0][0] - w.progress
        if w.role == "colocated" and w.chunk_left > 0:
            w.step += self.m.chunk_tokens / self.m.prefill_tps  # a step carrying a prompt chunk
            steps = min(steps, w.chunk_left / self.m.chunk_tokens)
        self.push(self.now + steps * w.step, "decode", (w, w.version))

    # colocated: prompts computed in chunks inside the decode steps; with no stream running, a prompt
    # runs alone at the prefill rate (as a prefill worker would).
    def _colocated_prefills(self, w: SimWorker) -> None:
        while w.queue and w.busy_until <= self.now:
            i = w.queue[0]
            t = 0.0
            if w.current != i:
                t, computed = self._prefill_time(w, self.reqs[i])
                self._remember(w, self.reqs[i])
                w.current, w.current_computed, w.chunk_left = i, computed, float(computed)
            if not w.streams and w.chunk_left > 0:  # alone: (the rest of) the prompt at the prefill rate
                if w.chunk_left < w.current_computed:
                    t = self.m.prefill_overhead_s + w.chunk_left / self.m.prefill_tps
                w.queue.pop(0)
                w.current, w.chunk_left = None, 0.0
                w.busy_until = self.now + t
                w.busy_s += t
                self.push(w.busy_until, "prefilled", (w, i, w.current_computed))
                return
            if w.chunk_left > 0:
                return  # carried by the decode steps; `_schedule` wakes us when it is done
            w.queue.pop(0)
            w.current = None
            self.push(self.now, "prefilled", (w, i, w.current_computed))

    # -- results ---------------------------------------------------------------------------

    def worker_hours(self, end: float) -> float:
        return sum(((w.removed_at if w.removed_at is not None else end) - w.added_at) for w in self.workers) / 3600


def attainment(outs: list[Outcome], ttft_slo: float, itl_slo: float) -> float:
    ok = sum(1 for o in outs if not math.isnan(o.done_at) and o.ttft <= ttft_slo and o.itl <= itl_slo)
    return ok / max(len(outs), 1)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(x for x in xs if not math.isnan(x))
    return xs[min(int(q * len(xs)), len(xs) - 1)] if xs else math.nan


def weighted_pct(pairs: list[tuple[float, float]], q: float) -> float:
    """The q-quantile of values weighted by counts: here, of every generated token's inter-token time."""
    pairs = sorted(pairs)
    total = sum(c for _, c in pairs)
    acc = 0.0
    for v, c in pairs:
        acc += c
        if acc >= q * total:
            return v
    return pairs[-1][0] if pairs else math.nan


def summary(fleet: Fleet, end: float) -> dict[str, float]:
    o = fleet.out
    done = [x for x in o if not math.isnan(x.done_at)]
    return {
        "requests": len(o), "completed": len(done),
        "slo_attainment": attainment(o, fleet.ttft_slo, fleet.itl_slo),
        "worker_hours": fleet.worker_hours(end),
        "ttft_p50_s": pct([x.ttft for x in o], 0.5), "ttft_p90_s": pct([x.ttft for x in o], 0.9),
        "itl_p50_ms": pct([x.itl for x in o], 0.5) * 1e3, "itl_p90_ms": pct([x.itl for x in o], 0.9) * 1e3,
        "token_itl_p90_ms": weighted_pct(fleet.token_itl, 0.9) * 1e3,
        "token_itl_p99_ms": weighted_pct(fleet.token_itl, 0.99) * 1e3,
        "cached_blocks_share": sum(x.cached_blocks for x in o) / max(sum(x.prompt_blocks for x in o), 1),
    }


def scaled(reqs: list[TraceRequest], scale: Scale, speed: float) -> list[TraceRequest]:
    """The requests `loadtest/trace_replay.py` sends for the same `--block`, `--max-output` and `--speed`:
    lengths in its tokens, arrivals compressed (simulate with `block_tokens=scale.block`)."""
    return [TraceRequest(r.at_s / speed, scale.input_tokens(r), scale.output_tokens(r), r.hash_ids) for r in reqs]


COPY_BLOCKS = 1 << 52  # a copy's block ids are moved by this much per copy (trace ids and UNIQUE_BLOCKS are below)


def superposed(reqs: list[TraceRequest], copies: int, spread_s: float = 600.0) -> list[TraceRequest]:
    """`copies` copies of the trace served together, copy k arriving k x spread_s / copies later, each with its own
    block ids (a copy shares no prefix with another): the same daily shape at `copies` times the load, for a
    trace drawn below its source's rate (the ServeGen day is drawn at 0.125 of the published rate, in 10-minute
    windows: copies spread within one window keep its shape)."""
    if copies < 1 or copies > 15:
        raise ValueError(f"--copies must be 1-15, got {copies}")
    out = [TraceRequest(r.at_s + k * spread_s / copies, r.input_length, r.output_length,
                        tuple(h + k * COPY_BLOCKS for h in r.hash_ids))
           for k in range(copies) for r in reqs]
    out.sort(key=lambda r: r.at_s)
    return out


def cached_tokens(fleet: Fleet) -> dict[str, float]:
    """Prompt tokens served from a cache against an infinite shared cache's (trace_replay's `cached_vs_ideal`)."""
    # (the requests are in the replay's tokens already: lengths are not scaled again)
    ideal = sum(leading_cached(fleet.reqs, [r.input_length for r in fleet.reqs], fleet.block))
    cached = sum(o.cached_blocks * fleet.block for o in fleet.out)
    return {"cached_tokens": cached, "ideal_cached_tokens": ideal,
            "cached_vs_ideal": cached / ideal if ideal else math.nan}


def simulate(reqs: list[TraceRequest], model: CostModel, **kw) -> tuple[Fleet, dict[str, float]]:
    fleet = Fleet(reqs, model, **kw)
    fleet.run()
    end = max((o.done_at for o in fleet.out if not math.isnan(o.done_at)), default=0.0)
    return fleet, summary(fleet, end)


# -- validation against a live replay -----------------------------------------------------------


def compare_live(live: dict, model: CostModel, *, prefill: int, decode: int, policy: str, store: bool,
                 trace: str = "") -> dict[str, dict[str, float]]:
    """The requests a `trace_replay --json` run sent, simulated on `model`, side by side with what the live
    run measured: cache hits against the ideal, TTFT percentiles (the same percentile function on both),
    the mean TTFT of each burst of arrivals (relative difference) and requests' mean inter-token times."""
    a = live["args"]
    scale = Scale(a["block"], 2, max_output=a["max_output"])
    raw = read_trace(trace or a["trace"], limit=a["limit"], start_s=a["start"], window_s=a["window"])
    reqs = scaled(raw, scale, a["speed"])
    fleet, _ = simulate(reqs, model, prefill=prefill, decode=decode, layout="disaggregated", policy=policy,
                        store=store, ttft_slo=a["ttft_slo"], itl_slo=a["itl_slo"], block_tokens=scale.block)
    outs = live["requests"]
    ok = [o for o in outs if o["error"] is None and o["ttft_s"] is not None]
    pairs = [(o["ttft_s"], fleet.out[o["index"]].ttft) for o in ok]
    itl_live = [statistics.fmean(o["gaps_s"]) for o in ok if o["gaps_s"]]
    itl_sim = [fleet.out[o["index"]].itl for o in ok if o["gaps_s"]]
    sim_cached = cached_tokens(fleet)

    def row(live_v: float, sim_v: float) -> dict[str, float]:
        return {"live": live_v, "sim": sim_v, "sim_vs_live": sim_v / live_v if live_v else math.nan}

    out = {"cached_vs_ideal": row(live["summary"]["cached_vs_ideal"], sim_cached["cached_vs_ideal"])}
    for q in (50, 90, 99):
        out[f"ttft_p{q}_s"] = row(workload_pct([x for x, _ in pairs], q), workload_pct([y for _, y in pairs], q))
    out["itl_mean_p50_ms"] = row(workload_pct(itl_live, 50) * 1e3, workload_pct(itl_sim, 50) * 1e3)
    out["itl_mean_p90_ms"] = row(workload_pct(itl_live, 90) * 1e3, workload_pct(itl_sim, 90) * 1e3)
    # The trace's arrivals are whole seconds: a burst's requests arrive together and the live router takes
    # them in whatever order they reach it, so TTFTs are compared per burst (their mean), not per request.
    bursts: dict[float, list[tuple[float, float]]] = {}
    for o, pair in zip(ok, pairs, strict=True):
        bursts.setdefault(reqs[o["index"]].at_s, []).append(pair)
    rel = [abs(statistics.fmean(y for _, y in b) / statistics.fmean(x for x, _ in b) - 1) for b in bursts.values()]
    out["burst_mean_ttft"] = {"bursts": len(bursts), "median_rel_diff": statistics.median(rel),
                              "p90_rel_diff": workload_pct(rel, 90)}
    return out


# -- autoscaling ------------------------------------------------------------------------------


@dataclass
class Scaler:
    """Runs every interval inside the simulation: the planner or a CPU HPA deciding each role's size."""

    kind: str  # planner | cpu_hpa | schedule
    interval: float
    startup: float
    limits: Limits
    planner: Planner | None = None
    plan: list[tuple[int, int]] = field(default_factory=list)  # schedule: (prefill, decode) per interval
    sample_s: float = 5.0  # planner: the live planner's scrape period inside an interval (its burst windows)
    history: list[tuple[float, int, int]] = field(default_factory=list)
    # planner: (time, what the interval showed, the decision's reasons) each interval
    decisions: list[tuple[float, str, list[str]]] = field(default_factory=list)
    _last: dict[str, float] = field(default_factory=dict)
    _busy: dict[int, float] = field(default_factory=dict)
    _recs: dict[str, list[tuple[float, int]]] = field(default_factory=lambda: {"prefill": [], "decode": []})
    _seen: dict[str, int] = field(default_factory=lambda: {"arrived": 0, "firsts": 0, "dones": 0})

    def _since(self, name: str, log: list[tuple[float, int]], now: float) -> list[int]:
        """The requests of `log` (time-ordered) up to `now` not handed out before: this interval's."""
        start = end = self._seen[name]
        while end < len(log) and log[end][0] <= now:
            end += 1
        self._seen[name] = end
        return [i for _, i in log[start:end]]

    def __call__(self, fleet: Fleet) -> None:
        now = fleet.now
        arrived = self._since("arrived", fleet.arrivals, now)
        firsts = [fleet.out[i].ttft for i in self._since("firsts", fleet.firsts, now)]
        done = [fleet.out[i].itl for i in self._since("dones", fleet.dones, now)]
        have = {role: len(fleet.live(role)) - sum(1 for w in fleet.live(role) if w.draining) for role in
                ("prefill", "decode")}
        if self.kind == "planner":
            assert self.planner is not None
            rs = [fleet.reqs[i] for i in arrived]
            lens, outs = [r.input_length for r in rs], [r.output_length for r in rs]
            blocks = sum(len(r.hash_ids) for r in rs)
            # the prompt tokens per `sample_s` of the interval, as the live planner's scrapes see them: its bursts
            n_bins = max(round(self.interval / self.sample_s), 1)
            bins = [[self.interval / n_bins, 0.0] for _ in range(n_bins)]
            for r in rs:
                bins[min(max(int((r.at_s - now + self.interval) * n_bins / self.interval), 0), n_bins - 1)][1] += \
                    r.input_length
            snap = Snapshot(request_rate=len(rs) / self.interval,
                            mean_input_tokens=statistics.fmean([r.input_length for r in rs]) if rs else 0.0,
                            mean_output_tokens=statistics.fmean([r.output_length for r in rs]) if rs else 0.0,
                            prefix_hit_ratio=(sum(fleet.out[i].cached_blocks for i in arrived) / blocks) if blocks else 0.0,
                            ttft_p90_s=pct(firsts, 0.9) if firsts else 0.0, itl_p90_s=pct(done, 0.9) if done else 0.0,
                            prefill_workers=have["prefill"], decode_workers=have["decode"], at_s=now,
                            prompt_peaks=prompt_peaks([(dt, n) for dt, n in bins]) if n_bins > 1 else (),
                            first_token_rate=len(firsts) / self.interval,
                            prompt_cv2=statistics.pvariance(lens) / statistics.fmean(lens) ** 2 if len(lens) > 1 else None,
                            output_cv2=statistics.pvariance(outs) / statistics.fmean(outs) ** 2
                            if len(outs) > 1 and sum(outs) else None)
            d = self.planner.decide(snap)
            self.decisions.append((now, f"{len(rs)} arrived, {len(firsts)} first tokens (TTFT p90 {snap.ttft_p90_s:.2f} s), "
                                        f"ITL p90 {snap.itl_p90_s * 1e3:.0f} ms", d.reasons))
            want = {"prefill": d.prefill, "decode": d.decode}
        elif self.kind == "schedule":  # (the interval starting now, and those a new worker's start-up ahead)
            p, dec = foreseen(self.plan, round(now / self.interval), self.startup, self.interval)
            want = {"prefill": p, "decode": dec}
        else:
            want = {}
            for role in ("prefill", "decode"):
                ws = fleet.live(role)
                util = statistics.fmean([(w.busy_s - self._busy.get(id(w), 0.0)) / self.interval for w in ws]) if ws else 0
                for w in ws:
                    self._busy[id(w)] = w.busy_s
                desired = have[role] if abs(util / 0.7 - 1) <= 0.1 else math.ceil(have[role] * util / 0.7)
                lo = self.limits.min_prefill if role == "prefill" else self.limits.min_decode
                hi = self.limits.max_prefill if role == "prefill" else self.limits.max_decode
                desired = min(max(desired, lo), hi)
                # scale-down stabilization: the highest recommendation of the last 5 minutes
                recs = self._recs[role]
                recs.append((now, desired))
                recs[:] = [(t, n) for t, n in recs if t > now - 300]
                want[role] = max(n for _, n in recs) if desired < have[role] else desired
        for role in ("prefill", "decode"):
            while want[role] > have[role]:
                fleet.add(role, now + self.startup)
                have[role] += 1
            while want[role] < have[role]:
                fleet.drain(role)
                have[role] -= 1
        self.history.append((now, len(fleet.live("prefill")), len(fleet.live("decode"))))


def run_scaled(reqs: list[TraceRequest], model: CostModel, scaler: Scaler, start: tuple[int, int], policy: str,
               store: bool, ttft_slo: float, itl_slo: float,
               block_tokens: int = TRACE_BLOCK) -> tuple[dict[str, float], Scaler]:
    fleet = Fleet(reqs, model, prefill=start[0], decode=start[1], layout="disaggregated", policy=policy,
                  store=store, ttft_slo=ttft_slo, itl_slo=itl_slo, block_tokens=block_tokens)
    fleet.run(tick=scaler.interval, on_tick=scaler)
    end = max((o.done_at for o in fleet.out if not math.isnan(o.done_at)), default=0.0)
    return summary(fleet, end), scaler


def warm_start(reqs: list[TraceRequest], model: CostModel, args: argparse.Namespace, limits: Limits) -> tuple[int, int]:
    """The fleet a planner that had been running before the trace began would have at its start: its
    decision on the first interval's arrivals (no prefix hits counted, no SLO missed), from 1 + 1."""
    first = [r for r in reqs if r.at_s < args.interval] or reqs[:1]
    snap = Snapshot(request_rate=len(first) / args.interval,
                    mean_input_tokens=statistics.fmean([r.input_length for r in first]),
                    mean_output_tokens=statistics.fmean([r.output_length for r in first]),
                    prefix_hit_ratio=0.0, ttft_p90_s=0.0, itl_p90_s=0.0, prefill_workers=1, decode_workers=1)
    d = new_planner(model, args, limits).decide(snap)
    return d.prefill, d.decode


def foreseen(plan: list[tuple[int, int]], k: int, startup: float, interval: float) -> tuple[int, int]:
    """The workers a schedule that knows its future keeps during interval `k` of `plan`: each role's most over
    intervals k to k + a start-up — a worker needed within a start-up is kept (draining it and starting another
    would cost as much and serve less), and one the plan needs that far ahead is started now, ready when it is
    needed. With no start-up, the plan's own counts."""
    ahead = math.ceil(round(startup / interval, 9)) if startup > 0 else 0
    window = plan[min(k, len(plan) - 1): k + ahead + 1] or plan[-1:]
    return max(p for p, _ in window), max(d for _, d in window)


def clairvoyant(reqs: list[TraceRequest], model: CostModel, split: tuple[int, int], target: float, interval: float,
                kw: dict, sweeps: int = 2, startup: float = 0.0) -> tuple[dict[str, float], list[tuple[int, int]]]:
    """What hindsight could do with autoscaling: a (prefill, decode) count per interval, found greedily — from
    `split` everywhere, each interval in turn gives up one worker of a role whenever the whole trace still meets
    `target` attainment, `sweeps` times over both roles. Each worker the schedule adds is started `startup` seconds
    before its interval and paid from then (`foreseen`: an autoscaler that knew the future would still wait for
    its workers to load); `startup` 0 is the looser bound of workers that serve the moment they are asked for.
    A feasible schedule, not a proven optimum: how far below a static split's worker-hours an autoscaler that
    knew the future could go (one simulation per try: minutes)."""
    end = max(r.at_s for r in reqs)
    plan = [list(split) for _ in range(int(end // interval) + 2)]

    def kept() -> list[tuple[int, int]]:
        sched = [(p, d) for p, d in plan]
        return [foreseen(sched, k, startup, interval) for k in range(len(sched))]

    def run() -> dict[str, float]:
        sched = [(p, d) for p, d in plan]
        summ, _ = run_scaled(reqs, model, Scaler("schedule", interval, startup, Limits(), plan=sched), kept()[0], **kw)
        return summ

    best = run()
    for _ in range(sweeps):
        for role in (0, 1):
            for k in range(len(plan)):
                if plan[k][role] <= 1:
                    continue
                before = kept()
                plan[k][role] -= 1
                if kept() == before:  # (a worker still kept for a later interval's need: nothing changes yet)
                    continue
                trial = run()
                if trial["slo_attainment"] >= target:
                    best = trial
                else:
                    plan[k][role] += 1
            print(f"clairvoyant: {best['slo_attainment']:.4f} at {best['worker_hours']:.3f} worker-hours",
                  file=sys.stderr, flush=True)
    return best, kept()


def clairvoyant_windows(reqs: list[TraceRequest], model: CostModel, target: float, window: float, most: int,
                        kw: dict, warmup: float = 600.0, startup: float = 0.0,
                        interval: float = 60.0) -> tuple[dict[str, float], list[tuple[int, int]]]:
    """Hindsight for a long trace (a day: `clairvoyant`'s greedy search would take thousands of whole-day
    simulations): each `window` of the trace gets the cheapest static split that meets `target` on the requests
    arriving in it (`static_splits` on the window's requests, the `warmup` seconds before it served first and not
    counted), and the schedule of those splits, each window's new workers started `startup` before it (`foreseen`,
    per `interval`), is then simulated whole. Feasible,
    not optimal: a window's split must meet the target on its own, where a whole-trace search could trade a
    hard window against an easy one."""
    end = max(r.at_s for r in reqs)
    plan: list[tuple[int, int]] = []
    for k in range(int(end // window) + 1):
        lo = max(k * window - warmup, 0.0)
        sub = [TraceRequest(r.at_s - lo, r.input_length, r.output_length, r.hash_ids) for r in reqs
               if lo <= r.at_s < (k + 1) * window]
        if not sub:
            plan.append(plan[-1] if plan else (1, 1))
            continue
        found = static_splits(sub, model, target, most, kw, counted_from=k * window - lo, quiet=True)
        good = {key: v for key, v in found.items() if v["slo_attainment"] >= target}
        key = (min(good, key=lambda key: (good[key]["worker_hours"], key)) if good
               else max(found, key=lambda key: found[key]["slo_attainment"]))
        p_, d_ = key.removesuffix("D").split("P")
        plan.append((int(p_), int(d_)))
        print(f"clairvoyant window {k}: {key} ({found[key]['slo_attainment']:.4f})", file=sys.stderr, flush=True)
    per = max(round(window / interval), 1)  # (the schedule acts every interval: a start-up is far shorter than a window)
    steps = [pd for pd in plan for _ in range(per)]
    summ, _ = run_scaled(reqs, model, Scaler("schedule", window / per, startup, Limits(), plan=steps),
                         foreseen(steps, 0, startup, window / per), **kw)
    return summ, plan


def new_planner(model: CostModel, args: argparse.Namespace, limits: Limits) -> Planner:
    """The planner `splitfire planner run` would be, deciding every `--interval` for one `--startup` ahead."""
    return Planner(model.profile(), args.ttft_slo, args.itl_slo, limits, interval_s=args.interval,
                   lead_s=args.startup, **planner_settings(args.planner_set))


def planner_settings(pairs: list[str]) -> dict[str, float]:
    """`--planner-set NAME=VALUE` pairs as `Planner` keyword arguments: each NAME one of its numeric settings (the
    values `planner/decision.py` documents), each VALUE a number; the Planner validates the values."""
    own_flags = {"ttft_slo_s", "itl_slo_s", "interval_s", "lead_s"}  # (--ttft-slo, --itl-slo, --interval, --startup)
    numeric = {f.name: f.type for f in fields(Planner)
               if not f.name.startswith("_") and f.type in ("float", "int") and f.name not in own_flags}
    out: dict[str, float] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or name not in numeric:
            raise SystemExit(f"--planner-set expects NAME=VALUE with NAME one of {sorted(numeric)}, got {pair!r}")
        try:
            out[name] = int(value) if numeric[name] == "int" else float(value)
        except ValueError:
            kind = "an integer" if numeric[name] == "int" else "a number"
            raise SystemExit(f"--planner-set {name}: {value!r} is not {kind}") from None
    return out


def static_splits(reqs: list[TraceRequest], model: CostModel, target: float, most: int, kw: dict,
                  counted_from: float = 0.0, quiet: bool = False) -> dict[str, dict[str, float]]:
    """The static prefill:decode splits (each role 1..`most`) that decide which is cheapest at `target` attainment,
    simulated: the fewest prefill workers that meet it beside `most` decode workers, then the fewest decode beside
    that many prefill (binary searches: attainment grows with either role), then the splits up to two above both,
    cheapest first, until one meets it. A split that cannot meet it stops as soon as more requests than the target
    allows have missed (`gave_up`): a hopeless split costs seconds, not a whole day's simulation. Only requests
    arriving from `counted_from` on count (the ones before warm the fleet up)."""
    statics: dict[str, dict[str, float]] = {}
    counted = [i for i, r in enumerate(reqs) if r.at_s >= counted_from]
    allowed = math.floor((1.0 - target) * len(counted) + 1e-9) + (len(reqs) - len(counted))

    def run(p: int, d: int) -> dict[str, float]:
        key = f"{p}P{d}D"
        if key not in statics:
            fleet = Fleet(reqs, model, prefill=p, decode=d, layout="disaggregated", **kw)
            fleet.give_up_after = allowed
            fleet.run()
            end = max((o.done_at for o in fleet.out if not math.isnan(o.done_at)), default=0.0)
            statics[key] = {**summary(fleet, end), "gave_up": fleet.misses > allowed}
            if counted_from > 0:
                statics[key]["slo_attainment"] = attainment([fleet.out[i] for i in counted], fleet.ttft_slo,
                                                            fleet.itl_slo)
            s = statics[key]
            if not quiet:
                print(f"static {p}P+{d}D: attainment {s['slo_attainment']:.3f}, {s['worker_hours']:.2f} worker-hours"
                      + (" (gave up: misses the target)" if s["gave_up"] else ""), file=sys.stderr, flush=True)
        return statics[key]

    def fewest(meets) -> int:  # (the smallest n in 1..most with meets(n); `most` if none)
        lo, hi = 1, most
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if meets(mid) else (mid + 1, hi)
        return lo

    p_min = fewest(lambda p: run(p, most)["slo_attainment"] >= target)
    d_min = fewest(lambda d: run(p_min, d)["slo_attainment"] >= target)
    for p, d in sorted(((p, d) for p in range(p_min, min(p_min + 2, most) + 1)
                        for d in range(d_min, min(d_min + 2, most) + 1)), key=lambda pd: (pd[0] + pd[1], pd)):
        if run(p, d)["slo_attainment"] >= target:
            break
    return statics


def planner_passes(reqs: list[TraceRequest], model: CostModel, args: argparse.Namespace, limits: Limits,
                   kw: dict) -> tuple[dict[str, float], Scaler, dict[str, float], tuple[int, int]]:
    """The planner over the trace as `--start` says: (its summary, its scaler — replicas and decisions per interval —,
    the earlier pass's attainment and worker-hours when `--start steady`, the fleet it started with)."""
    planner = new_planner(model, args, limits)
    start = warm_start(reqs, model, args, limits) if args.start == "warm" else (1, 1)
    first: dict[str, float] = {}
    if args.start == "steady":
        # A planner that had served this workload before: one earlier pass over the trace from 1 + 1, and the
        # measured pass begins with its fleet and what it learned (`Planner.learned`, as `--state` keeps it).
        f_sum, f_scaler = run_scaled(reqs, model, Scaler("planner", args.interval, args.startup, limits, planner),
                                     start, **kw)
        first = {"slo_attainment": f_sum["slo_attainment"], "worker_hours": f_sum["worker_hours"]}
        learned = planner.learned()
        planner = new_planner(model, args, limits)
        planner.resume(learned)
        start = f_scaler.history[-1][1], f_scaler.history[-1][2]
    p_sum, p_scaler = run_scaled(reqs, model, Scaler("planner", args.interval, args.startup, limits, planner),
                                 start, **kw)
    return p_sum, p_scaler, first, start


def compare_planner(reqs: list[TraceRequest], model: CostModel, args: argparse.Namespace) -> dict[str, object]:
    limits = Limits(min_prefill=1, max_prefill=args.max_workers, min_decode=1, max_decode=args.max_workers)
    kw = dict(policy=args.policy, store=args.store, ttft_slo=args.ttft_slo, itl_slo=args.itl_slo,
              block_tokens=args.block or TRACE_BLOCK)
    p_sum, p_scaler, first, start = planner_passes(reqs, model, args, limits, kw)
    if args.decisions:
        write_decisions(p_scaler, args.decisions)
    result: dict[str, object] = {
        "planner": {**p_sum, "replicas": p_scaler.history, **({"first_pass": first} if first else {})},
        "settings": {"ttft_slo_s": args.ttft_slo, "itl_slo_s": args.itl_slo, "interval_s": args.interval,
                     "startup_s": args.startup, "max_workers": args.max_workers, "cost_model": args.cost_model,
                     "policy": args.policy, "store": args.store, "requests": len(reqs),
                     "start": args.start, "start_workers": list(start),
                     **({"clairvoyant_startup_s": args.clairvoyant_startup} if args.clairvoyant else {})}}
    if args.planner_only:
        return result
    h_sum, h_scaler = run_scaled(reqs, model, Scaler("cpu_hpa", args.interval, args.startup, limits), start, **kw)
    statics = static_splits(reqs, model, p_sum["slo_attainment"], args.max_workers, kw)
    good = {k: v for k, v in statics.items() if v["slo_attainment"] >= p_sum["slo_attainment"]}
    best = min(good, key=lambda k: statics[k]["worker_hours"]) if good else \
        max(statics, key=lambda k: statics[k]["slo_attainment"])
    result.update({"best_static": {**statics[best], "split": best}, "cpu_hpa": {**h_sum, "replicas": h_scaler.history},
                   "statics": statics})
    if args.clairvoyant and args.clairvoyant_window:
        c_sum, plan = clairvoyant_windows(reqs, model, statics[best]["slo_attainment"], args.clairvoyant_window,
                                          args.max_workers, kw, startup=args.clairvoyant_startup,
                                          interval=args.interval)
        result["clairvoyant"] = {**c_sum, "window_s": args.clairvoyant_window, "plan": plan}
    elif args.clairvoyant:
        p_, d_ = best.removesuffix("D").split("P")
        c_sum, plan = clairvoyant(reqs, model, (int(p_), int(d_)), statics[best]["slo_attainment"], args.interval, kw,
                                  startup=args.clairvoyant_startup)
        result["clairvoyant"] = {**c_sum, "from": best, "plan": plan}  # (the workers kept per interval)
    return result


def write_decisions(scaler: Scaler, path: str) -> None:
    """The planner's measured pass, one line per interval: the time, the workers after it decided, what the interval
    showed it (requests arrived, first tokens and their p90, the finished requests' ITL p90), and its reasons."""
    with open(path, "w") as f:
        for (t, p, d), (_, seen, reasons) in zip(scaler.history, scaler.decisions, strict=True):
            f.write(f"{t:8.0f} s  {p}P{d}D  seen: {seen} | " + " | ".join(reasons) + "\n")


def plot(result: dict[str, object], reqs: list[TraceRequest], path: str) -> None:
    """The load (prompt and output tokens/s per minute on an hour's trace, per 5 minutes on a longer one) above each
    role's workers over the trace: the planner, the HPA, the clairvoyant schedule (when run) and the best static
    split."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = max(r.at_s for r in reqs)
    unit, label = (3600.0, "hours") if end > 3 * 3600 else (60.0, "minutes")
    fig, (load, prefill, decode) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    width = 300.0 if end > 3 * 3600 else 60.0
    bins = int(end // width) + 1
    prompt, output = [0.0] * bins, [0.0] * bins
    for r in reqs:
        prompt[int(r.at_s // width)] += r.input_length / width
        output[int(r.at_s // width)] += r.output_length / width
    t = [k * width / unit for k in range(bins)]
    load.step(t, prompt, where="post", label="prompt tokens/s")
    load.step(t, output, where="post", label="output tokens/s")
    load.set_ylabel("load")
    load.legend(loc="upper right")
    best = result["best_static"]["split"]  # type: ignore[index]
    p_, d_ = (int(x) for x in str(best).removesuffix("D").split("P"))
    for ax, col, role, fixed in ((prefill, 1, "prefill", p_), (decode, 2, "decode", d_)):
        for name, style in (("planner", "-"), ("cpu_hpa", ":")):
            hist = result[name]["replicas"]  # type: ignore[index]
            ax.step([h[0] / unit for h in hist], [h[col] for h in hist], style, where="post", label=name)
        if "clairvoyant" in result:
            c = result["clairvoyant"]
            step = c.get("window_s", result["settings"]["interval_s"])  # type: ignore[index,union-attr]
            plan = c["plan"]  # type: ignore[index]
            ax.step([k * step / unit for k in range(len(plan))], [pd[col - 1] for pd in plan], "--", where="post",
                    label="clairvoyant")
        ax.axhline(fixed, color="grey", linewidth=0.8, label=f"best static ({best})")
        ax.set_ylabel(f"{role} workers")
        ax.legend(loc="upper right", fontsize="small")
    decode.set_xlabel(f"{label} into the trace")
    fig.tight_layout()
    fig.savefig(path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default="", help="the trace file (with --compare-live: the live run's)")
    p.add_argument("--limit", type=int, default=None, help="first N requests only")
    p.add_argument("--copies", type=int, default=1, help="serve this many copies of the trace at once, each "
                   "--copies-spread/N seconds after the last and with its own prefixes: N times the load, same shape")
    p.add_argument("--copies-spread", type=float, default=600.0, help="seconds over which the copies' starts spread")
    p.add_argument("--window", type=float, default=None, help="first S seconds of the trace only")
    p.add_argument("--cost-model", default="h200-llama3-8b", choices=sorted(COST_MODELS))
    p.add_argument("--cost-model-json", default="", help="a worker measured here (loadtest/cpu_cost_model.py) instead")
    p.add_argument("--store-blocks", type=int, default=0, help="with --cost-model-json: the store's blocks "
                   "(default: what every worker lends, as many as its own cache)")
    p.add_argument("--block", type=int, default=None, help="simulate trace_replay's scaled requests: tokens per "
                   "trace block (with --speed and --max-output as given to it)")
    p.add_argument("--speed", type=float, default=1.0, help="with --block: arrivals compressed by this factor")
    p.add_argument("--max-output", type=int, default=64, help="with --block: scaled output tokens capped at this")
    p.add_argument("--layout", default="disaggregated", choices=("disaggregated", "colocated"))
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--workers", type=int, default=None, help="colocated: workers (default prefill + decode)")
    p.add_argument("--policy", default="token", choices=("token", "round_robin", "random"))
    p.add_argument("--store", action="store_true", help="a cluster KV store shared by the prefill workers")
    p.add_argument("--ttft-slo", type=float, default=2.0, help="seconds")
    p.add_argument("--itl-slo", type=float, default=0.05, help="seconds (mean inter-token time per request)")
    p.add_argument("--compare-planner", action="store_true")
    p.add_argument("--compare-live", default="", metavar="JSON",
                   help="a trace_replay --json run: simulate the requests it sent and print both side by side "
                        "(--prefill/--decode/--policy/--store as the live fleet; --cost-model-json its workers)")
    p.add_argument("--interval", type=float, default=60.0, help="autoscaling interval, seconds")
    p.add_argument("--startup", type=float, default=60.0, help="seconds before a new worker takes requests")
    p.add_argument("--start", default="steady", choices=("cold", "warm", "steady"),
                   help="--compare-planner: the autoscaled fleets begin at 1 prefill + 1 decode (cold), at what "
                   "the planner decides for the first interval's arrivals (warm), or with the fleet and the learned "
                   "state of a planner that had run over the trace once before (steady: as one kept with --state)")
    p.add_argument("--clairvoyant-window", type=float, default=0.0, metavar="S",
                   help="--clairvoyant on a long trace: the cheapest split per S-second window, found window by window "
                        "(default 0: the greedy per-interval search over the whole trace)")
    p.add_argument("--clairvoyant", action="store_true",
                   help="--compare-planner: also search (greedily, minutes) a per-interval schedule that knows the "
                        "future and meets the best static split's attainment with the fewest worker-hours found")
    p.add_argument("--clairvoyant-startup", type=float, default=None, metavar="S",
                   help="--clairvoyant: the start-up its workers take, started that far ahead and paid from then "
                        "(default: --startup, as the planner's; 0: workers that serve the moment they are asked for)")
    p.add_argument("--max-workers", type=int, default=12, help="autoscaling: most workers per role; static: in all")
    p.add_argument("--planner-only", action="store_true",
                   help="--compare-planner: the planner's passes only (no static splits, HPA or clairvoyant): "
                        "seconds to a minute on an hour's trace, for trying the planner's settings")
    p.add_argument("--planner-set", action="append", default=[], metavar="NAME=VALUE",
                   help="--compare-planner: one of the planner's numeric settings (planner/decision.py's Planner: "
                        "target_utilization, down_margin, forecast_quantile, burst_quantile, ...) for trying it; "
                        "repeatable")
    p.add_argument("--decisions", default="", metavar="FILE",
                   help="--compare-planner: write the measured pass's decisions there, one line per interval")
    p.add_argument("--json", default="")
    p.add_argument("--plot", default="")
    args = p.parse_args()
    if not args.block and (args.speed != 1.0 or args.max_output != 64):
        p.error("--speed and --max-output scale a replay's requests: give --block too")
    if args.copies == 1 and args.copies_spread != 600.0:
        p.error("--copies-spread spreads the copies of --copies N (N > 1): give --copies too")
    if (args.planner_only or args.decisions or args.planner_set) and not args.compare_planner:
        p.error("--planner-only, --decisions and --planner-set are --compare-planner's: give --compare-planner too")
    if args.planner_only and (args.clairvoyant or args.plot):
        p.error("--planner-only runs no clairvoyant schedule or static splits to plot: drop --clairvoyant / --plot")
    if args.clairvoyant_startup is None:
        args.clairvoyant_startup = args.startup
    elif args.clairvoyant_startup < 0 or not args.clairvoyant:
        p.error("--clairvoyant-startup is --clairvoyant's start-up, seconds >= 0: give --clairvoyant too")
    if args.clairvoyant_window and not (args.compare_planner and args.clairvoyant):
        p.error("--clairvoyant-window is --clairvoyant's window: give --compare-planner --clairvoyant too")
    if args.cost_model_json:
        measured = json.loads(Path(args.cost_model_json).read_text())
        workers = args.workers or args.prefill + args.decode
        model = CostModel.from_measured(measured, args.store_blocks or measured["kv_blocks"] * workers)
    else:
        model = COST_MODELS[args.cost_model]
    if args.planner_set:
        try:
            new_planner(model, args, Limits())
        except ValueError as e:
            p.error(f"--planner-set: {e}")
    if args.compare_live:
        if not args.cost_model_json:
            p.error("--compare-live needs --cost-model-json: the live run's workers, measured on its machine")
        if args.block or args.limit or args.window or args.compare_planner or args.layout != "disaggregated":
            p.error("--compare-live takes its requests and their scaling from the live run (no --block, --limit, "
                    "--window, --compare-planner) and simulates a disaggregated fleet")
        live = json.loads(Path(args.compare_live).read_text())
        cmp = compare_live(live, model, prefill=args.prefill, decode=args.decode, policy=args.policy, store=args.store,
                           trace=args.trace)
        print(json.dumps(cmp, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(cmp, indent=1))
        return 0
    if not args.trace:
        p.error("--trace is required")
    reqs = read_trace(args.trace, limit=args.limit, window_s=args.window)
    if args.copies != 1:
        reqs = superposed(reqs, args.copies, args.copies_spread)
    block = args.block or TRACE_BLOCK
    if args.block:
        reqs = scaled(reqs, Scale(args.block, 2, max_output=args.max_output), args.speed)
    if args.compare_planner:
        result: dict[str, object] = compare_planner(reqs, model, args)
        for name in ("planner", "best_static", "cpu_hpa", "clairvoyant"):
            if name not in result:
                continue
            r = result[name]
            print(f"{name:<12} attainment {r['slo_attainment']:.3f}  worker-hours {r['worker_hours']:.2f}  "  # type: ignore[index]
                  f"TTFT p90 {r['ttft_p90_s']:.2f} s  ITL p90 {r['itl_p90_ms']:.1f} ms"  # type: ignore[index]
                  + (f"  ({r['split']})" if name == "best_static" else ""))  # type: ignore[index]
        if args.plot:
            plot(result, reqs, args.plot)
    else:
        layout = args.layout
        if layout == "colocated":
            n = args.workers or args.prefill + args.decode
            kw = dict(prefill=n, decode=0)
        else:
            kw = dict(prefill=args.prefill, decode=args.decode)
        fleet, result = simulate(reqs, model, layout=layout, policy=args.policy, store=args.store,
                                 ttft_slo=args.ttft_slo, itl_slo=args.itl_slo, block_tokens=block, **kw)
        result.update(cached_tokens(fleet))
        print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=list))
    return 0


if __name__ == "__main__":
    sys.exit(main())
