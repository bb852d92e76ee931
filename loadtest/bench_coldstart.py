"""Cold start, measured in one run next to what it cannot beat (issue #20).

For `splitfire serve` and `splitfire generate` on an already fetched model: process start ->
engine's weights loaded -> KV cache allocated -> worker ready -> first token, and the process's
peak RSS; beside them, `import torch` alone and one read of the weight files with the page cache
dropped for them (cold) and kept (warm). Medians over --rounds.

    python -m loadtest.bench_coldstart                      # SmolLM2 as served (4-bit)
    python -m loadtest.bench_coldstart --model DIR --kv-cache-gb 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.stack import ROOT, free_port

_ENGINE = re.compile(r"engine ready .* load_s=([0-9.]+) weights_s=([0-9.]+) kv_s=([0-9.]+) weights_mib=([0-9.]+) "
                     r"mapped=(\w+) rss_start_mib=([0-9.na]+) rss_weights_mib=(-?[0-9.na]+)")


@dataclass
class Start:
    marks: dict[str, float] = field(default_factory=dict)  # seconds after spawn
    weights_s: float = 0.0
    kv_s: float = 0.0
    peak_rss_mib: float = float("nan")  # generate exits before it can be read
    weights_mib: float = 0.0  # the loaded model's tensors
    mapped: bool = False  # served from the weight cache's mapping
    rss_start_mib: float = float("nan")  # the process's RSS when the engine began (imports done)
    rss_weights_mib: float = float("nan")  # RSS the weight load itself added


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SPLITFIRE_LOG_LEVEL": "INFO"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def import_torch_s(collector: bool = True) -> float:
    """`collector=False`: with the garbage collector off, as `splitfire` imports it (common/gc_heap.py)."""
    code = "import torch" if collector else "import gc; gc.disable(); import torch"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=_env())
    return time.perf_counter() - t0


def evict(files: list[Path]) -> None:
    """Drop the files' pages from the page cache (posix_fadvise DONTNEED: clean pages go, no
    privileges needed)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def weight_cache_files(model_dir: Path) -> list[Path]:
    """The model's entries in the weight cache (what a mapped start reads instead of the checkpoint)."""
    from engine.loading.weight_cache import cache_dir

    return sorted(cache_dir().glob(f"{model_dir.name}-*.safetensors"))


def read_s(model_dir: Path, cold: bool) -> tuple[float, int]:
    """Seconds to read every safetensors file once; `cold` first evicts them from the page cache."""
    files = sorted(model_dir.glob("*.safetensors"))
    if cold:
        evict(files)
    total = 0
    buf = bytearray(8 << 20)
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                total += n
    return time.perf_counter() - t0, total


# How a weight load gets the checkpoint's bytes into the parameters (`load_model`'s `staging`).
LOAD_PATHS = {
    "cpu": {"direct": "read straight into the parameters (the CPU path)",
            "staged": "through the staging ring (unpinned on CPU: the GPU path's logic)"},
    "cuda": {"staged": "pinned staging ring, copies overlapped with reads (the GPU path)",
             "pageable": "pageable temporaries, one synchronous copy each (before)"},
}


def load_probe(model_dir: str, device: str, path: str) -> None:
    """(In a fresh process.) Print the seconds `load_model` takes with the checkpoint `path`."""
    import torch

    from engine.loading.staging import Staging
    from engine.loading.weights import load_model

    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # the engine's defaults (--dtype auto)
    staging = {"direct": None, "pageable": False, "staged": Staging(dev)}[path]
    if dev.type == "cuda":
        torch.cuda.init()
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    load_model(model_dir, dev, dtype, staging=staging)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    print(f"load_s={time.perf_counter() - t0:.4f}")


def load_s(model_dir: Path, device: str, path: str) -> float:
    # (The collector off, as `splitfire` runs the load: common/gc_heap.py.)
    code = (f"import gc; gc.disable(); from loadtest.bench_coldstart import load_probe; "
            f"load_probe({str(model_dir)!r}, {device!r}, {path!r})")
    out = subprocess.run([sys.executable, "-c", code], env={**_env(), "SPLITFIRE_WEIGHT_CACHE": "0"}, cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return float(out.stdout.rsplit("load_s=", 1)[1])


def _peak_rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _parse(start: Start, m: re.Match) -> None:
    start.weights_s, start.kv_s = float(m.group(2)), float(m.group(3))
    start.weights_mib, start.mapped, start.rss_start_mib = float(m.group(4)), m.group(5) == "True", float(m.group(6))
    start.rss_weights_mib = float(m.group(7))


def _follow(proc: subprocess.Popen, t0: float, start: Start, until: str) -> None:
    assert proc.stdout is not None
    for raw in proc.stdout:
        line = raw.decode(errors="replace")
        now = time.perf_counter() - t0
        m = _ENGINE.search(line)
        if m:
            start.marks["engine ready"] = now
            _parse(start, m)
        if until in line:
            start.marks[until] = now
            return
    raise RuntimeError(f"process exited before {until!r} (rc {proc.wait()})")


async def _first_token(address: str, prompt_ids: list[int]) -> None:
    import grpc

    from protos import splitfire_pb2 as pb
    from protos import splitfire_pb2_grpc as pbg

    async with grpc.aio.insecure_channel(address) as ch:
        req = pb.GenerateRequest(token_ids=prompt_ids, sampling=pb.SamplingParams(max_tokens=1, temperature=0))
        async for ev in pbg.DecodeStub(ch).Generate(req):
            if ev.token_ids:
                return
    raise RuntimeError("no token")


def serve_start(model: str, kv_gb: float, threads: int, cold: bool, model_dir: Path, extra_env: dict | None = None,
                device: str = "cpu") -> Start:
    if cold:  # evict the checkpoint and the weight cache's copy, so the worker reads from disk
        evict(sorted(model_dir.glob("*.safetensors")) + weight_cache_files(model_dir))
    grpc_port = free_port()
    cmd = [sys.executable, "-m", "splitfire_cli", "serve", "--model", model, "--device", device, "--host", "127.0.0.1",
           "--grpc-port", str(grpc_port), "--metrics-port", str(free_port()), "--kv-cache-gb", str(kv_gb),
           "--threads", str(threads)]
    start = Start()
    t0 = time.perf_counter()
    env = {**_env(), **(extra_env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        _follow(proc, t0, start, "worker ready")
        asyncio.run(_first_token(f"127.0.0.1:{grpc_port}", list(range(10, 42))))
        start.marks["first token"] = time.perf_counter() - t0
        start.peak_rss_mib = _peak_rss_mib(proc.pid)
    finally:
        proc.terminate()
        proc.wait(30)
    return start


def generate_start(model: str, kv_gb: float, threads: int, device: str = "cpu") -> Start:
    with tempfile.TemporaryDirectory() as d:
        inp, out = Path(d) / "in.jsonl", Path(d) / "out.jsonl"
        inp.write_text(json.dumps({"prompt_token_ids": list(range(10, 42)), "max_tokens": 1}) + "\n")
        cmd = [sys.executable, "-m", "splitfire_cli", "generate", "--model", model, "--device", device, "--kv-cache-gb",
               str(kv_gb), "--threads", str(threads), "--input", str(inp), "--output", str(out)]
        start = Start()
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT)
        assert proc.stdout is not None
        for raw in proc.stdout:
            m = _ENGINE.search(raw.decode(errors="replace"))
            if m:
                start.marks["engine ready"] = time.perf_counter() - t0
                _parse(start, m)
        if proc.wait() != 0:
            raise RuntimeError(f"generate exited with {proc.returncode}")
        start.marks["first token (exit)"] = time.perf_counter() - t0
        if not json.loads(out.read_text().splitlines()[0]).get("token_ids"):
            raise RuntimeError("generate produced no token")
    return start


def main() -> int:
    from engine.loading.model_store import resolve_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the built-in SmolLM2 (fetched first if needed)")
    p.add_argument("--kv-cache-gb", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cpu", help="cpu, or cuda: process start to first token on a GPU (the weight "
                   "cache is CPU-only, so there every start reads the checkpoint)")
    args = p.parse_args()
    model_dir = resolve_model(args.model)
    model = str(model_dir)

    def med(xs: list[float]) -> float:
        return statistics.median(xs)

    torch_s = med([import_torch_s() for _ in range(args.rounds)])
    torch_held_s = med([import_torch_s(collector=False) for _ in range(args.rounds)])
    cold_read = [read_s(model_dir, cold=True) for _ in range(args.rounds)]
    warm_read = [read_s(model_dir, cold=False) for _ in range(args.rounds)]
    nbytes = cold_read[0][1]
    dev = args.device
    serve_warm = [serve_start(model, args.kv_cache_gb, args.threads, False, model_dir, device=dev)
                  for _ in range(args.rounds)]
    serve_cold = [serve_start(model, args.kv_cache_gb, args.threads, True, model_dir, device=dev)
                  for _ in range(args.rounds)]
    gen = [generate_start(model, args.kv_cache_gb, args.threads, dev) for _ in range(args.rounds)]
    uncached = [serve_start(model, args.kv_cache_gb, args.threads, False, model_dir, {"SPLITFIRE_WEIGHT_CACHE": "0"},
                            device=dev) for _ in range(args.rounds)]
    # The collector on through start-up (common/gc_heap.py holds it off), interleaved with the default.
    held, unheld = [], []
    for _ in range(args.rounds):
        held.append(serve_start(model, args.kv_cache_gb, args.threads, False, model_dir, device=dev))
        unheld.append(serve_start(model, args.kv_cache_gb, args.threads, False, model_dir, {"SPLITFIRE_GC_FREEZE": "0"},
                                  device=dev))

    print(f"\nmodel {model_dir} ({nbytes / 1e6:.0f} MB of weight files), device {dev}, KV cache {args.kv_cache_gb} GiB "
          f"(CPU), {args.threads} threads; medians of {args.rounds}")
    label = 'python -c "import torch"'
    print(f"{label:<40}{torch_s:>8.2f} s")
    label = '  the same, collector off (as splitfire)'
    print(f"{label:<40}{torch_held_s:>8.2f} s")
    print(f"{'read weight files, cold page cache':<40}{med([r[0] for r in cold_read]):>8.3f} s")
    print(f"{'read weight files, warm page cache':<40}{med([r[0] for r in warm_read]):>8.3f} s")
    for name, runs in (("serve, warm page cache", serve_warm), ("serve, cold page cache", serve_cold),
                       ("generate, warm page cache", gen),
                       ("serve, warm page cache, weight cache off (SPLITFIRE_WEIGHT_CACHE=0)", uncached),
                       ("serve, warm page cache, again (interleaved with the next)", held),
                       ("serve, warm page cache, collector on during start-up (SPLITFIRE_GC_FREEZE=0)", unheld)):
        print(f"\n{name}: seconds after process start")
        for mark in runs[0].marks:
            print(f"  {mark:<38}{med([r.marks[mark] for r in runs]):>8.2f}")
        print(f"  {'(weights loaded in, engine-measured)':<38}{med([r.weights_s for r in runs]):>8.3f}")
        print(f"  {'(KV cache allocated in)':<38}{med([r.kv_s for r in runs]):>8.3f}")
        print(f"  {'(weights mapped from the cache)':<38}{sum(r.mapped for r in runs):>6}/{len(runs)}")
        if runs[0].peak_rss_mib == runs[0].peak_rss_mib:  # not NaN
            peak, base = med([r.peak_rss_mib for r in runs]), med([r.rss_start_mib for r in runs])
            weights = med([r.weights_mib for r in runs])
            added = med([r.rss_weights_mib for r in runs])
            weights = max(weights, 1e-9)
            print(f"  {'weights, MiB (the loaded tensors)':<38}{weights:>8.0f}")
            print(f"  {'RSS added by loading them, MiB':<38}{added:>8.0f}  = {added / weights:.2f}x the weights")
            print(f"  {'peak RSS, MiB':<38}{peak:>8.0f}")
            print(f"  {'  of which before the engine (imports)':<38}{base:>8.0f}")
            print(f"  {'  added since (weights, tokenizer,':<38}{peak - base:>8.0f}  = {(peak - base) / weights:.2f}x the "
                  "weights")
            print(f"  {'   grammar engine, first forward)':<38}")
    paths = LOAD_PATHS["cuda" if dev.startswith("cuda") else "cpu"]
    loads = {path: [] for path in paths}
    for _ in range(args.rounds):  # interleaved, so drift hits every path alike
        for path in paths:
            loads[path].append(load_s(model_dir, dev, path))
    warm = med([r[0] for r in warm_read])
    print("\nweight load from the checkpoint (weight cache off, warm page cache), in a fresh process, seconds")
    for path, what in paths.items():
        print(f"  {path:<10}{med(loads[path]):>8.3f}  = {med(loads[path]) / warm:.1f}x the warm read   {what}")
    w = med([r.weights_s for r in serve_warm])
    print(f"\nweight load / warm read: {w / med([r[0] for r in warm_read]):.1f}x;  ready - import torch: "
          f"{med([r.marks['worker ready'] for r in serve_warm]) - torch_held_s:.2f} s (import with the collector off)")
    print("targets (issue #20): ready <= 2 s after import torch; load <= 1.5x the raw read; peak RSS <= 1.2x "
          "(weights + KV cache)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
