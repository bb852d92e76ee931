"""One stream served against the same engine in process: what the serving path adds to each token.

Issue #31's target: one stream through `splitfire up` has an inter-token p50 within 1.05x of the
engine's own step time in process. Both are measured in one run, in alternating rounds (this VM's speed
drifts by 20% within an hour, so only side-by-side numbers compare):

- **in process**: an `LLMEngine` in this process built from the worker's own flags (`worker.config`'s
  parser, role `both`, so the engine is configured exactly as the colocated worker's), one request at a
  time — the gap between consecutive steps that give the request a token;
- **served**: `splitfire up --colocated` on the same model, one client streaming `/v1/completions` (the
  gap between consecutive SSE chunks, as `vs_llama_server` measures it), with the CPU each process of
  the stack spent per token (router, the worker's engine thread and compute threads, the rest of the
  worker, and this load generator) and their context switches per token from /proc.

The workload is `vs_llama_server`'s: ~256-token prompts of words, 128 tokens out, greedy, `ignore_eos`.

    python -m loadtest.bench_served_itl                          # the built-in SmolLM2 GGUF
    python -m loadtest.bench_served_itl --rounds 5 --out loadtest/results/served_itl.txt
    python -m loadtest.bench_served_itl --worker-arg=--threads=1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from engine.compute_threads import ENGINE_THREAD
from loadtest.bench_host import Proc, _cpu_s, cpu_flags, shell_cpu_s, stack_procs
from loadtest.stack import Stack
from loadtest.vs_llama_server import MAX_TOKENS, closed_loop, prompt
from loadtest.workload import pct


def _switches(path: str, kind: str = "") -> int:
    """Context switches of /proc/<pid>[/task/<tid>]/status: `kind` "voluntary" (it blocked: a futex, a
    socket), "nonvoluntary" (preempted), or both."""
    n = 0
    with open(path) as f:
        for line in f:
            if line.startswith(f"{kind}ctxt_switches" if kind else ("voluntary_ctxt", "nonvoluntary_ctxt")):
                n += int(line.split()[1])
    return n


def _threads(pid: int) -> list[int]:
    return [int(t) for t in os.listdir(f"/proc/{pid}/task")]


def _comm(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return ""


def snapshot(procs: list[Proc]) -> dict[str, float]:
    """CPU seconds and context switches per part of the stack and of this process. The worker's engine
    threads (its "sf-engine" thread and the compute threads it started, which come and go: an idle
    engine ends them) are told from the long-lived rest of the worker by name: the engine's CPU is the
    process's total less the rest's (a thread that ended keeps counting in the total); its context
    switches are those of its live threads (one that ended between snapshots loses its own)."""
    out: dict[str, float] = {}
    me = os.getpid()
    out["client cpu"] = _cpu_s(f"/proc/{me}/stat")
    out["client switches"] = sum(_switches(f"/proc/{me}/task/{t}/status") for t in _threads(me))
    out["client preempted"] = sum(_switches(f"/proc/{me}/task/{t}/status", "non") for t in _threads(me))
    for p in procs:
        part = "router" if p.role == "router" else "worker"
        tids = _threads(p.pid)
        names = {t: _comm(p.pid, t) for t in tids}
        groups = {"router": tids} if part == "router" else {
            "worker engine": [t for t in tids if names[t] == ENGINE_THREAD],
            "worker shell": [t for t in tids if names[t] != ENGINE_THREAD]}
        for name, ts in groups.items():
            for t in ts:
                try:
                    out[f"{name} switches:{t}"] = _switches(f"/proc/{p.pid}/task/{t}/status")
                    out[f"{name} preempted:{t}"] = _switches(f"/proc/{p.pid}/task/{t}/status", "non")
                except OSError:  # (ended since listed)
                    pass
        total = _cpu_s(f"/proc/{p.pid}/stat")
        if part == "router":
            out["router cpu"] = out.get("router cpu", 0.0) + total
        else:
            shell = shell_cpu_s(p.pid)
            out["worker shell cpu"] = out.get("worker shell cpu", 0.0) + shell
            out["worker engine cpu"] = out.get("worker engine cpu", 0.0) + total - shell
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """after - before per part; per-thread counters summed over the threads alive at `after`."""
    out: dict[str, float] = {}
    for k, v in after.items():
        part = k.split(":")[0]
        out[part] = out.get(part, 0.0) + v - before.get(k, 0.0)
    return out


def in_process_gaps(engine, tokenizer, n_requests: int, seed: int) -> tuple[list[float], list[float]]:
    """One request at a time: gaps (s) between the steps that give it tokens, and the time to its first."""
    from common.sampling_params import SamplingParams

    rng = random.Random(seed)
    gaps: list[float] = []
    ttfts: list[float] = []
    for i in range(n_requests):
        ids = tokenizer.encode(prompt(rng))
        engine.add_request(f"ip-{seed}-{i}", ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                                  ignore_eos=True))
        t0 = time.perf_counter()
        last = None
        while engine.has_work:
            outs = engine.step()
            if not any(o.token_ids for o in outs):
                continue
            now = time.perf_counter()
            if last is None:
                ttfts.append(now - t0)
            else:
                gaps.append(now - last)
            last = now
    return gaps, ttfts


def build_engine(model: str, worker_args: list[str]):
    """The engine a colocated worker builds from these flags (its own parser and config function)."""
    import gc

    import torch

    from engine.llm_engine import LLMEngine
    from worker.config import add_worker_args, engine_config_from

    p = argparse.ArgumentParser()
    add_worker_args(p, "both")
    args = p.parse_args(["--model", model, *worker_args])
    cfg = engine_config_from(args)
    torch.set_num_threads(cfg.threads or len(os.sched_getaffinity(0)))  # (the supervisor gives a lone worker every core)
    eng = LLMEngine(cfg)
    gc.collect()
    gc.freeze()  # as a serving process does once ready (common/gc_heap.py)
    return eng


def main() -> int:
    from engine.loading.model_store import DEFAULT_MODEL, builtin_gguf

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="a model directory or GGUF (default: the built-in SmolLM2 GGUF)")
    p.add_argument("--rounds", type=int, default=3, help="alternating in-process / served rounds")
    p.add_argument("--requests", type=int, default=4, help="requests per in-process round")
    p.add_argument("--duration", type=float, default=15.0, help="seconds of served load per round")
    p.add_argument("--worker-arg", action="append", default=[], help="extra worker flag, for both (e.g. --threads=1)")
    p.add_argument("--layout", default="colocated", choices=("colocated", "pd"),
                   help="served by one colocated worker, or by 1 prefill + 1 decode worker")
    p.add_argument("--up-arg", action="append", default=[], help="extra `splitfire up` flag (served only)")
    p.add_argument("--hogs", type=int, default=0,
                   help="busy-looping processes beside both measurements (a host whose cores are shared: "
                        "how the engine's compute threads fare when they are not alone)")
    p.add_argument("--out", default="", help="append the table to this file")
    args = p.parse_args()
    model = args.model or str(builtin_gguf(DEFAULT_MODEL))

    ip_p50: list[float] = []
    sv_p50: list[float] = []
    sv_p99: list[float] = []
    ip_p99: list[float] = []
    parts: dict[str, list[float]] = {}
    layout = ["--colocated"] if args.layout == "colocated" else ["--prefill", "1", "--decode", "1"]
    up = [*layout, "--model", model, *(f"--worker-arg={a}" for a in args.worker_arg), *args.up_arg]
    with contextlib.ExitStack() as stack:
        logs = stack.enter_context(tempfile.TemporaryDirectory(prefix="served-itl-"))
        st = stack.enter_context(Stack("served-itl", up, Path(logs)))
        st.wait_ready()
        with urllib.request.urlopen(st.url + "/v1/models", timeout=10) as r:
            name = json.load(r)["data"][0]["id"]
        procs = stack_procs(st)
        # The in-process engine computes on the cores of the worker that streams (`up` splits them:
        # 1 prefill + 1 decode on 2 cores = one each), with as many threads.
        streamer = next(p for p in procs if p.role == ("serve" if args.layout == "colocated" else "decode"))
        cores = os.sched_getaffinity(streamer.pid)
        everywhere = os.sched_getaffinity(0)
        engine = build_engine(model, [f"--threads={len(cores)}", *args.worker_arg])
        tok = engine.tokenizer
        os.sched_setaffinity(0, cores)
        in_process_gaps(engine, tok, 1, seed=999)  # warm-up
        os.sched_setaffinity(0, everywhere)
        asyncio.run(closed_loop(st.url, name, 1, 3.0, seed=99))  # warm-up
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
        stack.callback(lambda: [h.kill() for h in hogs])
        for r in range(args.rounds):
            me = os.getpid()
            c0, w0 = _cpu_s(f"/proc/{me}/stat"), sum(_switches(f"/proc/{me}/task/{t}/status") for t in _threads(me))
            n0 = sum(_switches(f"/proc/{me}/task/{t}/status", "non") for t in _threads(me))
            os.sched_setaffinity(0, cores)
            try:
                gaps, _ = in_process_gaps(engine, tok, args.requests, seed=r)
            finally:
                os.sched_setaffinity(0, everywhere)
            n_tok = len(gaps) + args.requests
            parts.setdefault("in process cpu", []).append((_cpu_s(f"/proc/{me}/stat") - c0) / n_tok)
            parts.setdefault("in process switches", []).append(
                (sum(_switches(f"/proc/{me}/task/{t}/status") for t in _threads(me)) - w0) / n_tok)
            parts.setdefault("in process preempted", []).append(
                (sum(_switches(f"/proc/{me}/task/{t}/status", "non") for t in _threads(me)) - n0) / n_tok)
            ip_p50.append(pct(gaps, 50))
            ip_p99.append(pct(gaps, 99))
            before = snapshot(procs)
            results, _wall = asyncio.run(closed_loop(st.url, name, 1, args.duration, seed=r))
            after = snapshot(procs)
            bad = [s.error for s in results if s.error]
            if bad:
                raise RuntimeError(f"served round {r}: {len(bad)} request(s) failed, e.g. {bad[0]}")
            sgaps = [g for s in results for g in s.gaps]
            tokens = sum(s.tokens for s in results)
            sv_p50.append(pct(sgaps, 50))
            sv_p99.append(pct(sgaps, 99))
            for k, v in delta(before, after).items():
                parts.setdefault(k, []).append(v / tokens)
            print(f"  round {r}: in process p50 {ip_p50[-1] * 1e3:.2f} ms, served p50 {sv_p50[-1] * 1e3:.2f} ms "
                  f"({sv_p50[-1] / ip_p50[-1]:.3f}x)", flush=True)

    ratios = [s / i for s, i in zip(sv_p50, ip_p50, strict=True)]
    lines = [f"## {time.strftime('%Y-%m-%d %H:%M')} python -m loadtest.bench_served_itl "
             f"--layout {args.layout} --hogs {args.hogs} {' '.join(f'--worker-arg={a}' for a in args.worker_arg)} ({cpu_flags()})",
             f"model {Path(model).name}; in process on cores {sorted(cores)} with {len(cores)} thread(s), as the "
             f"streaming worker; ~256-token prompts, {MAX_TOKENS} tokens out, greedy, one stream; "
             f"{args.rounds} alternating rounds (medians over rounds)", "",
             "| | in process | served | served / in process |", "| --- | ---: | ---: | ---: |",
             f"| inter-token p50 | {statistics.median(ip_p50) * 1e3:.2f} ms | {statistics.median(sv_p50) * 1e3:.2f} ms "
             f"| {statistics.median(ratios):.3f}x (rounds: {', '.join(f'{x:.3f}' for x in ratios)}) |",
             f"| inter-token p99 | {statistics.median(ip_p99) * 1e3:.2f} ms | {statistics.median(sv_p99) * 1e3:.2f} ms "
             f"| {statistics.median(sv_p99) / statistics.median(ip_p99):.3f}x |", "",
             "per token (prefill included): | CPU ms | context switches | of which preempted |",
             "| --- | ---: | ---: | ---: |"]
    for part in ("in process", "router", "worker engine", "worker shell", "client"):
        cpu = statistics.median(parts.get(f"{part} cpu", [0.0])) * 1e3
        sw = statistics.median(parts.get(f"{part} switches", [0.0]))
        pre = statistics.median(parts.get(f"{part} preempted", [0.0]))
        lines.append(f"| {'served: ' if part != 'in process' else ''}{part} | {cpu:.3f} | {sw:.2f} | {pre:.2f} |")
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
