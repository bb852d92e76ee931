"""KV transfer between prefill and decode workers split over tensor-parallel ranks, alike and not.

A random Llama (`random_models`, 8 layers, 4 KV heads of 64, float32), one prefill and one decode
worker per pairing (`-tp a` into `-tp b`), prompts of `--prompt` tokens prefilled remotely one at a
time; per pairing: the prefill worker's transfer bytes and Mooncake write entries per request (from
its metrics), the wall time of a request's writes (first layer write to last completion, the
`kv_transfer_seconds` histogram's mean) and the client's time to first token, medians over prompts.
Split alike, rank r writes whole pages into rank r; split differently, each page moves as head slices:
into more decode ranks gathered into staged pages first (`worker/kv/staging.py`), into fewer as whole
pages into spare decode blocks moved into place there (`KVCache.land`); a pair `a:b:rows` turns that
off on the decode side (`--no-kv-landing`: one entry per `[k|v, slot]` row).

    python -m loadtest.bench_tp_transfer --pairs 2:2,2:1,2:1:rows,1:2,1:1 --prompt 1024 --requests 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc

from loadtest.random_models import model_dir
from loadtest.stack import free_port
from protos import splitfire_pb2 as pb
from protos import splitfire_pb2_grpc as pbg

TRANSFER_METRICS = ("splitfire_worker_kv_transfer_bytes_total", "splitfire_worker_kv_transfer_entries_total",
                    "splitfire_worker_kv_transfer_seconds_sum")


class Worker:
    def __init__(self, role: str, model: Path, tp: int, log_dir: Path, extra: list[str]):
        self.port = free_port()
        self.metrics = free_port({self.port})  # (neither is bound yet: two draws can meet)
        self.log = log_dir / f"{role}-tp{tp}-{self.port}.log"
        args = [sys.executable, "-m", "splitfire_cli", role, "--model", str(model), "--device", "cpu",
                "--grpc-port", str(self.port), "--metrics-port", str(self.metrics), "--host", "127.0.0.1",
                "--kv-cache-gb", "0.25", "--tensor-parallel-size", str(tp), *extra]
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "MC_LOG_LEVEL": "ERROR"})

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while "worker ready" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker did not start; see {self.log}")
            time.sleep(0.3)

    def metrics_now(self, names: tuple[str, ...]) -> list[float]:
        """Each metric's value (summed over its labels), from one scrape."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics", timeout=10) as r:
            lines = r.read().decode().splitlines()
        return [sum(float(line.split()[-1]) for line in lines if line.startswith((name + " ", name + "{")))
                for name in names]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def ttft(decode: Worker, prefill: Worker, ids: list[int]) -> float:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}") as ch:
        req = pb.GenerateRequest(token_ids=ids, prefill_endpoint=f"127.0.0.1:{prefill.port}",
                                 sampling=pb.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        t0, first = time.perf_counter(), None
        async for ev in pbg.DecodeStub(ch).Generate(req):
            if ev.prefill_mode and ev.prefill_mode != "remote":
                raise RuntimeError(f"prefilled {ev.prefill_mode}: {ev.prefill_reason}")
            if ev.token_ids and first is None:
                first = time.perf_counter() - t0
        assert first is not None
        return first


def bench_pair(model: Path, a: int, b: int, args: argparse.Namespace, log_dir: Path,
               rows_only: bool = False) -> dict[str, float]:
    pre = Worker("prefill", model, a, log_dir, ["--max-num-batched-tokens", "2048"])
    dec = Worker("decode", model, b, log_dir, ["--local-prefill-max-tokens", "0",
                                                *(["--no-kv-landing"] if rows_only else [])])
    try:
        pre.wait_ready()
        dec.wait_ready()
        rows: dict[str, list[float]] = {"bytes": [], "entries": [], "transfer_ms": [], "ttft_ms": []}
        for i in range(args.requests + 1):  # the first is a warm-up
            ids = [(7919 * (i + 1) + 31 * j) % 31000 + 100 for j in range(args.prompt)]
            before = pre.metrics_now(TRANSFER_METRICS)
            t = asyncio.run(ttft(dec, pre, ids))
            after = pre.metrics_now(TRANSFER_METRICS)
            if i == 0:
                continue
            rows["bytes"].append(after[0] - before[0])
            rows["entries"].append(after[1] - before[1])
            rows["transfer_ms"].append((after[2] - before[2]) * 1e3)
            rows["ttft_ms"].append(t * 1e3)
        return {k: statistics.median(v) for k, v in rows.items()}
    finally:
        pre.stop()
        dec.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", default="2:2,2:1,2:1:rows,1:2,1:1",
                   help="prefill TP:decode TP[:rows], comma-separated (rows: the decode worker offers no landing)")
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--requests", type=int, default=5)
    args = p.parse_args()
    model = model_dir("llama")
    print(f"random Llama (8 layers, 4 KV heads x 64, float32), {args.prompt}-token prompts, medians of "
          f"{args.requests}", flush=True)
    print("| prefill TP -> decode TP | bytes / request | write entries / request | transfer ms | TTFT ms |")
    print("| --- | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory(prefix="bench-tp-") as logs:
        for pair in args.pairs.split(","):
            a, b, *how = pair.split(":")
            r = bench_pair(model, int(a), int(b), args, Path(logs), rows_only=how == ["rows"])
            label = f"{a} -> {b}" + (" (row by row)" if how == ["rows"] else "")
            print(f"| {label} | {r['bytes']:,.0f} | {r['entries']:,.0f} | {r['transfer_ms']:.1f} | "
                  f"{r['ttft_ms']:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
