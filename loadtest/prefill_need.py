"""How many prefill workers each interval of a trace needs, known in hindsight, and what an online rule that only
sees the past would hold instead: the price of not knowing the next burst.

Each prompt is work of `overhead + input / prefill_tps` seconds of one worker (the cost model `loadtest.fleet_sim`
uses; every prompt computed whole: no prefix cache, as on traces without prefix hashes), arriving at its trace
time; the work is binned per `--bin` seconds. An interval's **need** is the fewest workers that serve its work as a
fluid queue (n seconds of work per second) whose backlog never exceeds n x the TTFT budget (the SLO less one mean
prompt's own service): no prompt waits past the SLO. The backlog an interval leaves at its need is carried into the
next. This is optimistic (a fluid splits a prompt across workers; placement is perfect), so the needs are lower
bounds of what the simulated fleet needs — `fleet_sim`'s clairvoyant windows land within a worker of them.

Then, side by side, in worker-intervals over the trace (prefill only):

- **per interval**: the sum of the needs (hindsight that could change the fleet every interval, with no start-up);
- **per window**: each `--window`-interval window held at its largest need (`fleet_sim --clairvoyant-window`'s
  shape);
- **online, the most of the last K**: each interval held at the largest need of the K intervals that had ended
  when it had to be decided — `--lead` intervals before it (a start-up of one interval and a decision at an
  interval's end: 2), the trace having been served once before (as `fleet_sim --start steady`) — and how many
  intervals that leaves short of their need, by how many workers. A planner that only sees the past cannot do
  better without missing, unless the load's next burst is predictable.

    python -m loadtest.prefill_need --trace ../shared/data/varying_load_traces/azure2023_code.jsonl --copies 8 \\
        --copies-spread 60
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from loadtest.fleet_sim import COST_MODELS, CostModel, superposed
from loadtest.trace_replay import TraceRequest, read_trace


@dataclass(frozen=True)
class Online:
    k: int  # intervals looked back
    worker_intervals: int
    short_intervals: int  # intervals held below their need
    short_workers: int  # the workers they lacked, summed


def work_bins(reqs: list[TraceRequest], model: CostModel, bin_s: float) -> list[float]:
    """Seconds of one prefill worker's work (the cost model's, each prompt computed whole) arriving in each `bin_s`
    of the trace."""
    end = max((r.at_s for r in reqs), default=0.0)
    bins = [0.0] * (int(end // bin_s) + 1)
    for r in reqs:
        bins[int(r.at_s // bin_s)] += model.prefill_overhead_s + model.prefill_time(r.input_length, 0)
    return bins


def needs(bins: list[float], bin_s: float, per_interval: int, budget_s: float, most: int = 256) -> list[int]:
    """Each interval's (`per_interval` bins) fewest workers whose fluid queue's backlog stays within `budget_s` of
    their own service (n x budget seconds of work), the backlog carried from the interval before at its need."""
    out: list[int] = []
    carried = 0.0
    for lo in range(0, len(bins), per_interval):
        chunk = bins[lo: lo + per_interval]
        for n in range(1, most + 1):
            q, ok = carried, True
            for w in chunk:
                q = max(q + w - n * bin_s, 0.0)
                if q > n * budget_s + 1e-9:
                    ok = False
                    break
            if ok:
                break
        out.append(n)
        carried = q
    return out


def windows(need: list[int], window: int) -> int:
    """Worker-intervals when each `window` intervals are held at their largest need."""
    return sum(max(need[i: i + window]) * len(need[i: i + window]) for i in range(0, len(need), window))


def online(need: list[int], k: int, lead: int) -> Online:
    """Each interval held at the most of the `k` needs that had ended `lead` intervals before it, the trace having
    been served once before (`fleet_sim --start steady`: the intervals before the first are the trace's last)."""
    seen = need * (1 + -(-(k + lead) // len(need)))  # (as many passes before as the look-back reaches)
    at = len(seen) - len(need)
    held = [max(seen[at + i - lead - k + 1: at + i - lead + 1]) for i in range(len(need))]
    short = [(h, n) for h, n in zip(held, need, strict=True) if h < n]
    return Online(k, sum(held), len(short), sum(n - h for h, n in short))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True)
    p.add_argument("--copies", type=int, default=1, help="as fleet_sim's: the trace served this many times over")
    p.add_argument("--copies-spread", type=float, default=600.0)
    p.add_argument("--cost-model", default="h200-llama3-8b", choices=sorted(COST_MODELS))
    p.add_argument("--ttft-slo", type=float, default=2.0, help="seconds")
    p.add_argument("--interval", type=float, default=60.0, help="seconds (fleet_sim's --interval)")
    p.add_argument("--bin", type=float, default=1.0, help="seconds per bin of arriving work")
    p.add_argument("--window", type=int, default=5, help="intervals per hindsight window")
    p.add_argument("--lead", type=int, default=2, help="intervals between deciding and serving (start-up + 1)")
    p.add_argument("--lookback", default="1,3,5,10,20,30", help="the K of the online rules, comma-separated")
    p.add_argument("--json", default="")
    args = p.parse_args()
    if args.bin <= 0 or args.interval <= 0 or args.interval % args.bin or args.window < 1 or args.lead < 1:
        p.error("--bin and --interval positive, --interval a whole number of bins, --window and --lead >= 1")
    model = COST_MODELS[args.cost_model]
    reqs = read_trace(args.trace)
    if args.copies != 1:
        reqs = superposed(reqs, args.copies, args.copies_spread)
    if not reqs:
        p.error(f"{args.trace}: no requests")
    mean_input = sum(r.input_length for r in reqs) / len(reqs)
    budget = args.ttft_slo - model.prefill_overhead_s - model.prefill_time(round(mean_input), 0)
    if budget <= 0:
        p.error(f"a mean prompt alone takes longer than the TTFT SLO ({args.ttft_slo} s)")
    bins = work_bins(reqs, model, args.bin)
    need = needs(bins, args.bin, round(args.interval / args.bin), budget)
    rules = [online(need, int(k), args.lead) for k in args.lookback.split(",")]
    out = {"intervals": len(need), "need": need, "per_interval": sum(need),
           "per_window": windows(need, args.window), "window": args.window, "lead": args.lead,
           "online": [r.__dict__ for r in rules]}
    print(f"need per {args.interval:g}-s interval (prefill workers): {' '.join(map(str, need))}")
    print(f"worker-intervals: per interval {out['per_interval']}, per {args.window}-interval window "
          f"{out['per_window']}")
    for r in rules:
        print(f"online, the most of the last {r.k:>2}: {r.worker_intervals} worker-intervals "
              f"({r.worker_intervals / out['per_window']:.2f}x the windows'), {r.short_intervals} intervals short "
              f"by {r.short_workers} workers")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
