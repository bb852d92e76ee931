"""The headline experiment: the same seeded mixed workload against a colocated worker with both
cores and against one prefill + one decode worker with one core each, same router.

Prints p50/p90/p99 TTFT and inter-token latency for both and the PD/colocated ratios,
then (with --goodput) raises the load until the TTFT SLO breaks and reports goodput
(requests/s meeting both SLOs) for each. Writes a PNG of inter-token gaps over time.

    python -m loadtest.bench_pd                 # ~4 minutes on 2 cores
    python -m loadtest.bench_pd --goodput       # + the load sweep (~8 minutes)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

from loadtest.stack import Stack
from loadtest.workload import goodput, mixed_workload, replay, summarize

CONFIGS = {
    "colocated": ["--colocated", "--cpus", "0-1"],
    "disaggregated": ["--prefill", "1", "--decode", "1", "--cpus", "0;1"],
}


def run_config(name: str, args: argparse.Namespace, jobs_by_phase: list, out_dir: Path) -> list:
    flags = [*CONFIGS[name], "--kv-cache-gb", str(args.kv_cache_gb), "--served-model-name", "bench"]
    if args.model:
        flags += ["--model", args.model]
    flags += [f"--worker-arg={a}" for a in args.worker_arg]
    if name == "disaggregated":
        flags += [f"--decode-arg={a}" for a in args.decode_arg]
    results = []
    with Stack(name, flags, out_dir) as stack:
        warm = mixed_workload(seed=99, duration_s=6, short_rate=1.0, long_every_s=5)
        asyncio.run(replay(stack.url, "bench", warm))  # compile paths, fill caches, touch memory
        for jobs in jobs_by_phase:
            t0 = time.perf_counter()
            res = asyncio.run(replay(stack.url, "bench", jobs))
            results.append((res, time.perf_counter() - t0))
            print(f"  {name}: {len(jobs)} requests in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    return results


def fmt_ms(v: float) -> str:
    return f"{v * 1000:8.1f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.environ.get("SPLITFIRE_MODEL"))
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load per configuration")
    p.add_argument("--short-rate", type=float, default=0.5, help="short chats per second")
    p.add_argument("--long-every", type=float, default=6.0, help="seconds between long prompts")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--kv-cache-gb", type=float, default=1.0)
    p.add_argument("--goodput", action="store_true", help="also sweep the load and report goodput")
    p.add_argument("--rates", default="0.5,1.0,1.5", help="short-chat rates for the goodput sweep")
    p.add_argument("--ttft-slo", type=float, default=2.0)
    p.add_argument("--itl-slo", type=float, default=0.15)
    p.add_argument("--out", default="loadtest/results")
    p.add_argument("--worker-arg", action="append", default=[], help="extra flag for every worker")
    p.add_argument("--decode-arg", action="append", default=[], help="extra flag for the PD decode worker")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    phases = [mixed_workload(args.seed, args.duration, args.short_rate, args.long_every)]
    rates = [float(r) for r in args.rates.split(",")] if args.goodput else []
    sweep_s = args.duration / 2
    phases += [mixed_workload(args.seed + i + 1, sweep_s, r, args.long_every) for i, r in enumerate(rates)]

    all_results = {name: run_config(name, args, phases, out) for name in CONFIGS}
    summ = {name: summarize(res[0][0]) for name, res in all_results.items()}
    c, d = summ["colocated"], summ["disaggregated"]
    n_long = sum(1 for j in phases[0] if j.kind == "long")
    print(f"\nworkload: {args.duration:.0f}s, {args.short_rate}/s short chats (30-60 words in, 64 tokens out) + a "
          f"long prompt (900-1400 words, 16 tokens out) every {args.long_every}s ({n_long} long, "
          f"{len(phases[0]) - n_long} short); seed {args.seed}")
    print(f"{'metric (ms)':<16}{'colocated':>12}{'disaggregated':>15}{'PD/colocated':>14}")
    for key in ("ttft_p50", "ttft_p90", "ttft_p99", "itl_p50", "itl_p90", "itl_p99"):
        ratio = d[key] / c[key] if c[key] else float("nan")
        print(f"{key:<16}{fmt_ms(c[key]):>12}{fmt_ms(d[key]):>15}{ratio:>14.2f}")
    print(f"{'errors':<16}{c['errors']:>12}{d['errors']:>15}")
    verdict_itl = d["itl_p90"] / c["itl_p90"]
    verdict_ttft = d["ttft_p90"] / c["ttft_p90"]
    print(f"\ntargets: p90 ITL ratio <= 0.33 -> {verdict_itl:.2f} ({'met' if verdict_itl <= 1 / 3 else 'NOT met'}); "
          f"p90 TTFT ratio <= 1.5 -> {verdict_ttft:.2f} ({'met' if verdict_ttft <= 1.5 else 'NOT met'})")

    if rates:
        print(f"\ngoodput (req/s meeting TTFT <= {args.ttft_slo}s and per-request p90 gap <= {args.itl_slo * 1000:.0f} ms)")
        print(f"{'short rate/s':<14}{'colocated':>12}{'disaggregated':>15}{'ratio':>8}")
        for i, r in enumerate(rates):
            gc = goodput(all_results["colocated"][i + 1][0], sweep_s, args.ttft_slo, args.itl_slo)
            gd = goodput(all_results["disaggregated"][i + 1][0], sweep_s, args.ttft_slo, args.itl_slo)
            print(f"{r:<14}{gc:>12.2f}{gd:>15.2f}{(gd / gc if gc else float('inf')):>8.2f}")

    (out / "bench_pd.json").write_text(json.dumps({"summary": summ, "args": vars(args)}, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(11, 4.5))
        for name, color in (("colocated", "tab:red"), ("disaggregated", "tab:blue")):
            res = all_results[name][0][0]
            xs = [t for r in res for t in r.gap_times]
            ys = [g * 1000 for r in res for g in r.gaps]
            ax.scatter(xs, ys, s=3, alpha=0.5, color=color, label=f"{name} (p90 {summ[name]['itl_p90'] * 1000:.0f} ms)")
        for j in phases[0]:
            if j.kind == "long":
                ax.axvline(j.at, color="grey", lw=0.5, ls=":")
        ax.set_yscale("log")
        ax.set_xlabel("seconds (dotted: a long prompt arrives)")
        ax.set_ylabel("inter-token gap (ms)")
        ax.set_title("Inter-token latency over time: colocated vs disaggregated (same workload, same 2 cores)")
        ax.legend(loc="upper right")
        fig.tight_layout()
        fig.savefig(out / "bench_pd_itl.png", dpi=120)
        print(f"\nplot: {out / 'bench_pd_itl.png'}")
    except ImportError:
        print("(matplotlib not installed: no plot)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
