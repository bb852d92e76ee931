"""Time from an SLO breach to a recovered SLO under a load step, live: `splitfire up --planner`.

1. Profile: `splitfire up --prefill 1 --decode 1` (one core each, one compute thread per worker), then
   `planner.profile.measure` through its router — what `splitfire planner profile` writes.
2. The same layout with `--planner` (that profile; the stepped role may grow to two workers, the other
   stays at one) under an open-loop Poisson load of streamed chats: `--low-rate` requests/s for `--before`
   seconds, then `--high-rate` for `--during` seconds (the step), then the low rate again for `--after`
   seconds (the planner drains the added worker). `--role decode`: short prompts, `--output` tokens each,
   judged by the ITL SLO; `--role prefill`: prompts of ~`--prompt-words` words and 8 output tokens,
   judged by the TTFT SLO.
3. The metric, bucketed into `--window`-second windows — decode: inter-token gaps by when each ended;
   prefill: each request's TTFT by when it arrived — and the p90 of each window against the SLO.
   Reported, in seconds after the step: the first window over the SLO (the breach), the planner's
   scale-up (its log line), the new worker ready, and the SLO recovered (the first window from which
   every window to the end of the step is within it); the scale-down and the failed requests (none
   expected: a drained worker finishes its streams).

The same step runs twice in one go, against a fixed 1 prefill + 1 decode fleet and with `--planner`, side
by side.

    python -m loadtest.bench_planner_step [--role prefill] [--ttft-slo 1] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import tempfile
import threading
import time
from pathlib import Path

from loadtest.stack import Stack
from loadtest.workload import Job, Result, pct, replay, text_of


def events(role: str) -> dict[str, re.Pattern]:
    """What `splitfire up` prints, under the name this benchmark reports it."""
    return {"scale_up": re.compile(rf"event=planner_scale role={role} from=1 to=2"),
            "ready": re.compile(rf"\[{role}-1\] .*worker ready"),
            "scale_down": re.compile(rf"event=planner_scale role={role} from=2 to=1")}


def step_jobs(a: argparse.Namespace) -> list[Job]:
    """Poisson arrivals at the low rate, the high one from `before` to `before + during`, then low again."""
    rng, jobs, t = random.Random(a.seed), [], 0.0
    end = a.before + a.during + a.after
    words, output = ((a.prompt_words * 4 // 5, a.prompt_words * 6 // 5), 8) if a.role == "prefill" else ((20, 40), a.output)
    while True:
        rate = a.high_rate if a.before <= t < a.before + a.during else a.low_rate
        t += rng.expovariate(rate)
        if t >= end:
            return jobs
        jobs.append(Job(t, "short", [{"role": "user", "content": text_of(rng, rng.randint(*words))}], output))


def samples(results: list[Result], role: str) -> list[tuple[float, float]]:
    """(when, value): decode — every inter-token gap at its end; prefill — every TTFT at its request's arrival."""
    if role == "prefill":
        return [(r.job.at, r.ttft) for r in results if r.ttft is not None]
    return [(at, g) for r in results for g, at in zip(r.gaps, r.gap_times, strict=True)]


def windows(points: list[tuple[float, float]], width: float, end: float) -> list[tuple[float, float, int]]:
    """(window start, p90 of the values in it, how many) for every window up to `end`."""
    buckets: dict[int, list[float]] = {}
    for at, v in points:
        buckets.setdefault(int(at // width), []).append(v)
    return [(i * width, pct(buckets.get(i, []), 90), len(buckets.get(i, []))) for i in range(int(end // width) + 1)]


class LogWatch:
    """Stamps the first time each of `EVENTS` appears in the stack's log (seconds on `time.perf_counter`)."""

    def __init__(self, path: Path, patterns: dict[str, re.Pattern]):
        self.path, self.patterns, self.seen = path, patterns, {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            text = self.path.read_text(errors="replace")
            now = time.perf_counter()
            for name, pattern in self.patterns.items():
                if name not in self.seen and pattern.search(text):
                    self.seen[name] = now
            time.sleep(0.05)


def analyse(results: list[Result], t0: float, seen: dict[str, float], a: argparse.Namespace) -> dict:
    """The step as the SLO saw it: times in seconds after the step began (None: did not happen)."""
    step, step_end = a.before, a.before + a.during
    slo = a.ttft_slo if a.role == "prefill" else a.itl_slo
    points = samples(results, a.role)
    win = windows(points, a.window, a.before + a.during + a.after)
    in_step = [(s, p90, n) for s, p90, n in win if step <= s < step_end and n]
    breach = next((s for s, p90, _ in in_step if p90 > slo), None)
    # Recovered: the first window after the breach from which `--hold` seconds of windows are all within it.
    recovered = next((s for s, _, _ in in_step if breach is not None and s > breach
                      and all(p90 <= slo for s2, p90, _ in in_step if s <= s2 < s + a.hold)), None)
    events = {k: round(v - t0 - step, 2) for k, v in seen.items()}
    during = [v for at, v in points if step <= at < step_end]
    return {
        "p90_before_step_s": pct([v for at, v in points if at < step], 90),
        "p90_during_step_s": pct(during, 90),
        "within_slo_during_step": sum(v <= slo for v in during) / len(during) if during else float("nan"),
        "windows_over_slo": sum(p90 > slo for _, p90, _ in in_step), "windows": len(in_step),
        "breach_s": None if breach is None else round(breach - step, 2),
        "scale_up_s": events.get("scale_up"), "worker_ready_s": events.get("ready"),
        "recovered_s": None if recovered is None else round(recovered - step, 2),
        "breach_to_recovered_s": None if breach is None or recovered is None else round(recovered - breach, 2),
        "scale_down_s_after_step": None if "scale_down" not in events else round(events["scale_down"] - a.during, 2),
        "requests": len(results), "failed": sum(r.error is not None for r in results),
        "window_p90_ms": [(round(s - step, 1), round(p90 * 1000, 1), n) for s, p90, n in win],
    }


async def run(a: argparse.Namespace) -> dict:
    """The same step twice: a fixed 1 prefill + 1 decode fleet, then the same with `--planner`."""
    from planner.profile import measure, save

    common = ["--model", a.model, "--prefill", "1", "--decode", "1", "--kv-cache-gb", str(a.kv_cache_gb),
              "--worker-arg=--threads=1", "--decode-arg=--local-prefill-max-tokens=0"]  # (every prompt: prefill's)
    logs = Path(tempfile.mkdtemp(prefix="bench_planner_step-"))
    profile_path = logs / "profile.json"
    if a.profile:
        profile_path = Path(a.profile)
    else:
        with Stack("profile", [*common, "--no-redis"], logs) as st:
            profile = await measure(st.url, await _model_name(st.url), [1, 2, 4, 8, 16],
                                    prompt_len=a.prompt_words * 3 // 2 if a.role == "prefill" else 64,
                                    decode_tokens=32, rounds=2)  # (prompts the size of the step's)
            save(profile, profile_path)
    print(f"profile: {profile_path.read_text()}", flush=True)
    planner = ["--planner", "--planner-profile", str(profile_path), "--planner-interval", str(a.interval),
               "--itl-slo", str(a.itl_slo), "--ttft-slo", str(a.ttft_slo),
               "--max-decode", "2" if a.role == "decode" else "1", "--max-prefill", "2" if a.role == "prefill" else "1"]
    jobs = step_jobs(a)
    out = {"role": a.role, "slo_s": a.ttft_slo if a.role == "prefill" else a.itl_slo,
           "profile": json.loads(profile_path.read_text()), "rates": [a.low_rate, a.high_rate], "seconds": [a.before, a.during, a.after], "window_s": a.window,
           "interval_s": a.interval}
    for name, extra in (("fixed", []), ("planner", planner)):
        with Stack(name, [*common, *extra], logs) as st:
            model = await _model_name(st.url)
            watch = LogWatch(st.log_path, events(a.role))
            t0 = time.perf_counter()
            results = await replay(st.url, model, jobs)
            watch.stop.set()
            print(f"{name}: stack log {st.log_path}", flush=True)
        out[name] = analyse(results, t0, watch.seen, a)
    return out


async def _model_name(url: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(url + "/v1/models") as r:
        return (await r.json())["data"][0]["id"]


def _cell(v: object) -> str:
    return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--profile", default="", help="a planner profile to use instead of measuring one")
    p.add_argument("--role", choices=["prefill", "decode"], default="prefill", help="the role the step loads")
    p.add_argument("--itl-slo", type=float, default=None, help="default 0.06 (--role decode), else 10 (not judged)")
    p.add_argument("--ttft-slo", type=float, default=None, help="default 1 (--role prefill), else 30 (not judged)")
    p.add_argument("--prompt-words", type=int, default=100, help="--role prefill: prompt size (words, +-20%%)")
    p.add_argument("--interval", type=float, default=5.0, help="--planner-interval")
    p.add_argument("--low-rate", type=float, default=None, help="requests/s (default 0.3 prefill, 0.5 decode)")
    p.add_argument("--high-rate", type=float, default=None, help="requests/s (default 3)")
    p.add_argument("--before", type=float, default=20.0)
    p.add_argument("--during", type=float, default=60.0)
    p.add_argument("--after", type=float, default=60.0)
    p.add_argument("--output", type=int, default=64, help="--role decode: output tokens per request (prefill: 8)")
    p.add_argument("--window", type=float, default=5.0)
    p.add_argument("--hold", type=float, default=15.0, help="recovered: this long of windows within the SLO")
    p.add_argument("--kv-cache-gb", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="")
    a = p.parse_args()
    prefill = a.role == "prefill"
    a.itl_slo = a.itl_slo if a.itl_slo is not None else (10.0 if prefill else 0.06)
    a.ttft_slo = a.ttft_slo if a.ttft_slo is not None else (1.0 if prefill else 30.0)
    a.low_rate = a.low_rate if a.low_rate is not None else (0.3 if prefill else 0.5)
    a.high_rate = a.high_rate if a.high_rate is not None else 3.0
    out = asyncio.run(run(a))
    print(f"{a.role} step {a.low_rate} -> {a.high_rate} req/s for {a.during:.0f} s, SLO p90 {out['slo_s']} s, "
          f"planner interval {a.interval:.0f} s, {a.window:.0f} s windows (times: s after the step began)")
    print(f"{'':>28} {'fixed 1P+1D':>14} {'--planner':>14}")
    for k in out["fixed"]:
        if k != "window_p90_ms":
            print(f"{k:>28} {_cell(out['fixed'][k]):>14} {_cell(out['planner'][k]):>14}")
    for name in ("fixed", "planner"):
        print(f"{name} window p90 ms (start:p90/n): "
              + " ".join(f"{s_}:{p}/{n}" for s_, p, n in out[name]["window_p90_ms"] if n))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
