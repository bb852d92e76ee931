"""Host CPU per generated token: the serving stack's own work, apart from the model's.

A random Llama whose compute is negligible (`random_models.host_model_dir`: hidden 64, 2 layers,
a 512-token vocabulary, SmolLM2's tokenizer) is served, so what the processes spend is what a GPU
host would spend around its device: scheduling, block tables, sampling bookkeeping, detokenizing,
streaming, the router's SSE.

Two tables, one run:

1. **Whole stack** (`splitfire up`, colocated and 1 prefill + 1 decode): N streams of M tokens
   (`ignore_eos`, token-id prompts), CPU-seconds (user + system, from /proc) per 1,000 generated
   tokens for every process of the stack — router, each worker split into its engine (its thread and
   torch's compute threads) and the rest (the serving shell: gRPC, HTTP frames, the event loop) — and
   output tokens/s. The load generator runs in this process and is not counted.
2. **Engine in process**: host time per decode step at batch 1, 16, 64 and 256, split into the
   engine's phases (`engine/batch/step_times.py`: schedule, prepare, forward, sample, commit,
   detokenize). On a CPU "forward" is the model's compute; on a GPU it is the launch.

`--flame DIR` also records each stack process with py-spy while the load runs (collapsed stacks,
`.txt`, and an `.svg` flame graph per process).

    python -m loadtest.bench_host                                   # 64 streams x 256 tokens
    python -m loadtest.bench_host --streams 16 --tokens 128 --layouts colocated --flame loadtest/results/host-cpu-per-token/epyc-avx512/flame
    python -m loadtest.bench_host --worker-streams mux,http --no-engine     # one connection vs one per stream
    python -m loadtest.bench_host --stream-relays direct,queued --no-engine  # the direct relays vs the streams' handlers
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import json
import os
import pstats
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.compute_threads import ENGINE_THREAD
from loadtest.stack import Stack

TICK = os.sysconf("SC_CLK_TCK")
ROLES = ("router", "serve", "prefill", "decode")


@dataclass
class Proc:
    pid: int
    role: str




def shell_cpu_s(pid: int) -> float:
    """CPU seconds of a worker's live threads other than its engine's (the serving shell: event loop,
    gRPC, frames). The engine's compute threads come and go (an idle engine ends them), so the engine's
    share is the process's total less this one (a thread that ended still counts in the total)."""
    total = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            if Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip() != ENGINE_THREAD:
                total += _cpu_s(f"/proc/{pid}/task/{tid}/stat")
        except OSError:  # (ended since listed)
            pass
    return total


def _cpu_s(path: str, system_only: bool = False) -> float:
    """utime + stime (or stime alone) of /proc/<pid>[/task/<tid>]/stat, in seconds."""
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[12]) + (0 if system_only else int(fields[11]))) / TICK


def _children(root: int) -> list[int]:
    """Every process below `root`."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        for c in kids.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def stack_procs(stack: Stack) -> list[Proc]:
    procs = []
    for pid in _children(stack.proc.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv]
        if "splitfire_cli" not in args:
            continue
        role = next((a for a in args[args.index("splitfire_cli") + 1:] if a in ROLES), None)
        if role is None:
            continue
        procs.append(Proc(pid, role))
    return sorted(procs, key=lambda p: ROLES.index(p.role))


def snapshot(procs: list[Proc]) -> dict[str, float]:
    out = {}
    for p in procs:
        name = f"{p.role}-{p.pid}"
        out[name] = _cpu_s(f"/proc/{p.pid}/stat")
        # the kernel's share (sockets, loopback delivery, futexes): what no Python-level cut reaches
        out[f"{name}:sys"] = _cpu_s(f"/proc/{p.pid}/stat", system_only=True)
        if p.role != "router":
            out[f"{name}:engine"] = out[name] - shell_cpu_s(p.pid)
    return out


@dataclass
class LoadResult:
    tokens: int = 0
    wall_s: float = 0.0
    errors: list[str] = field(default_factory=list)
    itl_ms: list[float] = field(default_factory=list)


async def run_load(url: str, model: str, streams: int, tokens: int, prompt_len: int, seed: int) -> LoadResult:
    """`streams` concurrent streamed completions of `tokens` tokens each (token-id prompts)."""
    import aiohttp

    rng = random.Random(seed)
    res = LoadResult()

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        body = {"model": model, "prompt": [rng.randrange(3, 500) for _ in range(prompt_len)], "max_tokens": tokens,
                "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        last = None
        async with session.post(f"{url}/v1/completions", json=body) as r:
            if r.status != 200:
                res.errors.append(f"{r.status}: {(await r.text())[:200]}")
                return
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                now = time.perf_counter()
                if last is not None:
                    res.itl_ms.append((now - last) * 1e3)
                last = now
                if b'"usage":{' in line and b'"choices":[]' in line:
                    res.tokens += json.loads(line[6:])["usage"]["completion_tokens"]

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(session, i) for i in range(streams)))
        res.wall_s = time.perf_counter() - t0
    return res


def flame(procs: list[Proc], out_dir: Path, tag: str, seconds: float) -> list[subprocess.Popen]:
    """py-spy on every stack process for `seconds` (started before the load, joined after)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    out_dir.mkdir(parents=True, exist_ok=True)
    recs = []
    for p in procs:
        for fmt, ext in (("raw", "txt"), ("flamegraph", "svg")):
            recs.append(subprocess.Popen(
                [spy, "record", "--pid", str(p.pid), "--duration", str(int(seconds)), "--rate", "250", "--threads",
                 "--nonblocking", "--format", fmt, "--output", str(out_dir / f"{tag}-{p.role}.{ext}")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return recs


def bench_stack(args: argparse.Namespace, layout: str, model_dir: Path, log_dir: Path,
                worker_stream: str = "mux", relay: str = "direct") -> dict[str, float]:
    up = ["--model", str(model_dir), "--device", args.device, "--no-redis", "--served-model-name", "host",
          f"--router-arg=--worker-stream={worker_stream}", f"--router-arg=--stream-relay={relay}",
          f"--decode-arg=--stream-relay={relay}"]
    up += ["--colocated"] if layout == "colocated" else ["--prefill", "1", "--decode", "1"]
    up += [f"--worker-arg=--max-num-seqs={max(args.streams, 64)}", "--worker-arg=--speculative=off",
           "--worker-arg=--kv-cache-gb=0.5", *(f"--worker-arg={a}" for a in args.worker_arg)]
    with Stack(f"host-{layout}-{worker_stream}-{relay}", up, log_dir) as stack:
        stack.wait_ready()
        # Warm-up: connections, the first steps of every batch size, the allocator, torch's threads.
        asyncio.run(run_load(stack.url, "host", args.streams, 16, args.prompt_len, 0))
        procs = stack_procs(stack)
        rows: dict[str, list[float]] = {}
        for r in range(args.rounds):
            recs = flame(procs, Path(args.flame), layout, args.flame_seconds) if args.flame and r == 0 else []
            before = snapshot(procs)
            res = asyncio.run(run_load(stack.url, "host", args.streams, args.tokens, args.prompt_len, r + 1))
            after = snapshot(procs)
            for rec in recs:
                rec.wait()
            if res.errors:
                raise RuntimeError(f"{layout}: {len(res.errors)} request(s) failed, e.g. {res.errors[0]}")
            k = 1000 / res.tokens
            total = 0.0
            for name in before:
                used = (after[name] - before[name]) * k
                rows.setdefault(name.split("-")[0] + (":" + name.split(":")[1] if ":" in name else ""), []).append(used)
                if ":" not in name:
                    total += used
            rows.setdefault("stack", []).append(total)
            rows.setdefault("tok/s", []).append(res.tokens / res.wall_s)
            rows.setdefault("itl_p50_ms", []).append(statistics.median(res.itl_ms))
    return {name: statistics.median(v) for name, v in rows.items()}


def bench_engine(args: argparse.Namespace, model_dir: Path) -> dict[int, dict[str, float]]:
    import torch

    from common.sampling_params import SamplingParams
    from engine.engine_config import EngineConfig
    from engine.llm_engine import LLMEngine

    torch.set_num_threads(1)
    batches = [int(b) for b in args.batches.split(",")]
    eng = LLMEngine(EngineConfig(model=str(model_dir), device=args.device, max_num_seqs=max(batches),
                                 max_num_batched_tokens=max(4096, max(batches)), kv_cache_gb=0.5, speculative="off",
                                 # every prompt in before timing: the CPU's cap of 24 prompt tokens per step
                                 # would let the first streams finish before the last start (a smaller batch)
                                 max_prefill_tokens_while_decoding=0))
    # as a serving process does once ready (common/gc_heap.py): the start-up heap frozen, so a
    # collection that lands in a step scans what requests allocated, not torch's and the model's objects
    gc.collect()
    gc.freeze()
    out: dict[int, dict[str, float]] = {}
    rng = random.Random(0)
    for b in batches:
        for i in range(b):
            eng.add_request(f"b{b}-{i}", [rng.randrange(3, 500) for _ in range(args.prompt_len)],
                            SamplingParams(max_tokens=2 * args.engine_steps + 20, temperature=0, ignore_eos=True))
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.seqs.values()):
            eng.step()
        for _ in range(5):
            eng.step()
        running = sum(1 for s in eng.seqs.values() if s.num_computed_tokens >= s.num_prompt_tokens)
        assert running == b, f"batch {b}: only {running} sequences decoding"
        times = eng.time_steps()
        cpu0, t0 = time.process_time(), time.perf_counter()
        for _ in range(args.engine_steps):
            eng.step()
        wall = (time.perf_counter() - t0) * 1e3 / args.engine_steps
        cpu = (time.process_time() - cpu0) * 1e3 / args.engine_steps
        eng.times = eng.runner.times = None
        row = times.per_step_ms()
        if args.profile and b == max(batches):  # after the timed steps: cProfile's overhead stays out of them
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.engine_steps // 2):
                eng.step()
            prof.disable()
            print(f"\ncProfile of {args.engine_steps // 2} more decode steps at batch {b} (by own time):")
            pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(25)
        row["step"], row["cpu"] = wall, cpu
        row["host"] = wall - row["forward"]
        out[b] = row
        for rid in list(eng.seqs):
            eng.abort(rid)
    return out


def cpu_flags() -> str:
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("model name")), "?")
    simd = "AVX-512" if "avx512f" in flags else ("AVX2" if "avx2" in flags else "no AVX2")
    return f"{os.cpu_count()} CPUs, {model}, {simd}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: the same model on a GPU (bfloat16, decode graphs): 'forward' is then the launch")
    p.add_argument("--tokens", type=int, default=256, help="generated tokens per stream")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="load rounds per layout (medians)")
    p.add_argument("--layouts", default="colocated,pd", help="colocated and/or pd (1 prefill + 1 decode)")
    p.add_argument("--batches", default="1,16,64,256", help="engine table: decode batch sizes")
    p.add_argument("--engine-steps", type=int, default=200, help="engine table: steps measured per batch size")
    p.add_argument("--no-engine", action="store_true", help="skip the in-process engine table")
    p.add_argument("--profile", action="store_true", help="engine table: cProfile the largest batch's steps")
    p.add_argument("--flame", default="", metavar="DIR", help="record every stack process with py-spy into DIR")
    p.add_argument("--flame-seconds", type=float, default=8.0)
    p.add_argument("--worker-arg", action="append", default=[], help="extra worker flag (e.g. --threads=1)")
    p.add_argument("--worker-streams", default="mux", help="the router's --worker-stream for each layout: "
                   "mux, http and/or grpc (several: side by side)")
    p.add_argument("--stream-relays", default="direct", help="the router's and the decode workers' "
                   "--stream-relay for each layout: direct and/or queued (several: side by side)")
    p.add_argument("--json", default="", help="also write the numbers here")
    args = p.parse_args()

    from loadtest.random_models import host_model_dir

    model_dir = host_model_dir()
    machine = cpu_flags()
    if args.device == "cuda":
        import torch

        machine += f", {torch.cuda.get_device_name()}"
    results: dict[str, object] = {"machine": machine, "device": args.device, "streams": args.streams,
                                  "tokens": args.tokens}
    log_dir = Path(tempfile.mkdtemp(prefix="bench-host-"))
    modes = [m for m in args.worker_streams.split(",") if m]
    relays = [r for r in args.stream_relays.split(",") if r]
    variants = [(m, r, "".join([f"/{m}"] * (len(modes) > 1) + [f"/{r}"] * (len(relays) > 1)))
                for m in modes for r in relays]
    stacks = {f"{layout}{tag}": bench_stack(args, layout, model_dir, log_dir, mode, relay)
              for layout in args.layouts.split(",") if layout for mode, relay, tag in variants}
    results["stack"] = stacks
    print(f"\n{results['machine']}; {args.streams} streams x {args.tokens} tokens, medians of {args.rounds} rounds")
    if stacks:
        names = sorted({n for s in stacks.values() for n in s} - {"tok/s", "itl_p50_ms", "stack"})
        print(
            "\nWhole stack: CPU-seconds per 1,000 generated tokens (engine = the worker's engine thread and torch's threads; sys = kernel time)")
        w = max(16, *(len(lay) + 2 for lay in stacks))
        print(f"{'process':<20}" + "".join(f"{lay:>{w}}" for lay in stacks))
        for n in [*names, "stack"]:
            print(f"{n:<20}" + "".join(f"{s.get(n, float('nan')):>{w}.4f}" for s in stacks.values()))
        print(f"{'output tok/s':<20}" + "".join(f"{s['tok/s']:>{w}.0f}" for s in stacks.values()))
        print(f"{'ITL p50 ms':<20}" + "".join(f"{s['itl_p50_ms']:>{w}.2f}" for s in stacks.values()))
        for _, _, tag in variants:
            if f"colocated{tag}" in stacks and f"pd{tag}" in stacks:
                print(f"{'pd / colocated' + tag:<20}"
                      f"{stacks[f'pd{tag}']['stack'] / stacks[f'colocated{tag}']['stack']:>14.2f}")
    if not args.no_engine:
        eng = bench_engine(args, model_dir)
        results["engine"] = eng
        cols = ["schedule", "prepare", "forward", "sample", "commit", "detokenize", "step", "host", "cpu"]
        print("\nEngine in process: ms per decode step (host = step - forward; cpu = the process's CPU time per step;"
              " 1 torch thread)")
        print(f"{'batch':<8}" + "".join(f"{c:>12}" for c in cols) + f"{'host us/tok':>13}")
        for b, row in eng.items():
            print(f"{b:<8}" + "".join(f"{row[c]:>12.3f}" for c in cols) + f"{row['host'] * 1e3 / b:>13.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    shutil.rmtree(log_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
