"""Several base models in one worker (`--on-demand-model`), measured in one run: how long a request for a
model that is not resident waits for it (its first load, and a reload after eviction, mapped from the weight
cache), against the same request to a resident model and against starting a worker for it from nothing
(process start to first token); and whether load/evict cycles leave memory behind (the worker's RSS).

Three copies of one model (hard links under distinct directory names: three "models" of the same size)
behind `splitfire serve --model A --on-demand-model B --on-demand-model C --max-loaded-models 2`: B and C
evict each other on every request for the other.

    python -m loadtest.bench_model_host                      # SmolLM2 as served (4-bit)
    python -m loadtest.bench_model_host --model DIR --rounds 7 --out loadtest/results/model_host.txt
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc

from loadtest.stack import ROOT, free_port
from protos import splitfire_pb2 as pb
from protos import splitfire_pb2_grpc as pbg

PROMPT = [(7 * j) % 300 + 3 for j in range(16)]


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SPLITFIRE_LOG_LEVEL": "INFO"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def copies(model_dir: Path, root: Path, names: list[str]) -> list[Path]:
    """Hard-linked copies of `model_dir` under distinct names (a worker tells its models apart by name)."""
    out = []
    for name in names:
        dst = root / name
        if not dst.exists():
            dst.mkdir(parents=True)
            for f in model_dir.iterdir():
                if f.is_file():
                    os.link(f, dst / f.name)
        out.append(dst)
    return out


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def spawn(args: list[str], log: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    fh = open(log, "w")  # (the process writes it for as long as it runs)
    proc = subprocess.Popen([sys.executable, "-m", "splitfire_cli", "serve", *args, "--device", "cpu",
                             "--grpc-port", str(port), "--metrics-port", str(free_port()), "--host", "127.0.0.1"],
                            stdout=fh, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT)
    return proc, port


async def first_token_s(port: int, model: str, timeout: float = 300.0) -> float:
    """Seconds from sending a one-token request to its token (retrying while the server starts)."""
    sampling = pb.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    while True:
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                req = pb.GenerateRequest(token_ids=PROMPT, sampling=sampling, model=model)
                async for ev in pbg.DecodeStub(ch).Generate(req, wait_for_ready=True, timeout=timeout):
                    if ev.token_ids:
                        return time.perf_counter() - t0
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or time.perf_counter() - t0 > timeout:
                raise
            await asyncio.sleep(0.02)


def wait_ready(proc: subprocess.Popen, log: Path, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while "worker ready" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"worker did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)


async def run(args: argparse.Namespace) -> str:
    from engine.loading.model_store import resolve_model

    work = Path(os.environ.get("SPLITFIRE_HOME", Path.home() / ".cache/splitfire")) / "bench-model-host"
    a, b, c = copies(resolve_model(args.model), work, ["host-a", "host-b", "host-c"])
    common = ["--kv-cache-gb", str(args.kv_cache_gb), "--threads", str(args.threads)]
    log = work / "host.log"
    proc, port = spawn(["--model", str(a), "--on-demand-model", str(b), "--on-demand-model", str(c),
                        "--max-loaded-models", "2", *common], log)
    rows: dict[str, list[float]] = {"resident": [], "first load": [], "reload (evicted before)": []}
    rss: list[float] = []
    try:
        wait_ready(proc, log)
        await first_token_s(port, "host-a")  # (warm the path)
        for name in ("host-b", "host-c"):
            rows["first load"].append(await first_token_s(port, name))
        rss.append(rss_mib(proc.pid))
        for _ in range(args.rounds):
            rows["resident"].append(await first_token_s(port, "host-a"))
            for name in ("host-b", "host-c"):  # each evicts the other
                rows["reload (evicted before)"].append(await first_token_s(port, name))
            rss.append(rss_mib(proc.pid))
    finally:
        proc.terminate()
        proc.wait(60)
    text = log.read_text()
    loads = [float(s) for s in re.findall(r"event=model_loaded model=host-[bc] footprint_mib=\S+ seconds=([0-9.]+)",
                                          text)]
    evicts = [float(s) for s in re.findall(r"event=model_evicted model=host-[bc] footprint_mib=\S+ seconds=([0-9.]+)",
                                           text)]
    freed = re.findall(r"event=model_freed model=\S+ freed=(\w+)", text)
    footprint = re.search(r"event=model_loaded model=host-b footprint_mib=([0-9.]+)", text)
    cold = []
    for i in range(args.cold_rounds):  # a worker for the model, started from nothing
        clog = work / f"cold-{i}.log"
        t0 = time.perf_counter()
        cproc, cport = spawn(["--model", str(b), *common], clog)
        try:
            await first_token_s(cport, "")
            cold.append(time.perf_counter() - t0)
        finally:
            cproc.terminate()
            cproc.wait(60)
    med = statistics.median
    lines = [
        f"model {resolve_model(args.model).name} (x3 hard-linked copies), footprint {footprint.group(1) if footprint else '?'}"
        f" MiB each (weights + {args.kv_cache_gb} GiB KV), --threads {args.threads}, rounds {args.rounds}",
        "",
        "| request to | time to first token, median (runs) |",
        "| --- | ---: |",
    ]
    for k, v in rows.items():
        lines.append(f"| {k} | {med(v) * 1000:.0f} ms ({len(v)}) |")
    lines.append(f"| a new worker for it, process start to first token (cold start) | {med(cold) * 1000:.0f} ms "
                 f"({len(cold)}) |")
    lines += [
        "",
        f"engine loads on demand: median {med(loads[2:] or loads) * 1000:.0f} ms after eviction "
        f"(first loads {', '.join(f'{x * 1000:.0f}' for x in loads[:2])} ms: tokenizer read, weight cache built if absent); "
        f"evictions median {med(evicts) * 1000:.0f} ms; engines freed at eviction: {freed.count('True')}/{len(freed)}",
        f"worker RSS after the first loads / after each round: {rss[0]:.0f} / "
        + ", ".join(f"{x:.0f}" for x in rss[1:]) + " MiB",
        f"reload / resident: {med(rows['reload (evicted before)']) / med(rows['resident']):.1f}x; "
        f"reload / cold start: {med(rows['reload (evicted before)']) / med(cold):.2f}x",
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cold-rounds", type=int, default=3)
    p.add_argument("--kv-cache-gb", type=float, default=0.25)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="", help="append the table to this file")
    args = p.parse_args()
    out = asyncio.run(run(args))
    print(out)
    if args.out:
        with open(args.out, "a") as f:
            f.write(f"\n## {time.strftime('%Y-%m-%d %H:%M')} {' '.join(sys.argv[1:])}\n{out}\n")


if __name__ == "__main__":
    main()
