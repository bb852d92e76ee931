"""The Batch API beside interactive traffic, and what the Messages API costs the router.

Part 1 (batch): one colocated worker (`splitfire up --colocated`, SmolLM2 by default). Interactive requests
(`--quiet-prompt` tokens in, `--quiet-tokens` out, streamed, one at a time) measured alone, then while a batch
of `--lines` chat requests (`--line-prompt` tokens in, `--line-tokens` out) runs through /v1/batches, then alone
again (both orders in one run): their TTFT and inter-token medians, and the batch's own throughput.

Part 2 (messages): a worker running the tiny test model and a router; closed-loop streams of `--tokens` tokens
through /v1/chat/completions and through /v1/messages (Anthropic's events), rounds alternating: the router's
CPU-microseconds per streamed token (from /proc: the load generator is not counted); medians.

    python -m loadtest.bench_batch            # both parts, ~10 minutes on 2 cores
    python -m loadtest.bench_batch --parts messages
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from loadtest.bench_host import cpu_flags
from loadtest.bench_router import cpu_seconds, spawn
from loadtest.bench_tenancy import _ids, stream
from loadtest.stack import ROOT, Stack, free_port

MODEL = "bench"


async def interactive(url: str, n: int, prompt: int, tokens: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    ttft, itl = [], []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as s:
        for _ in range(n):
            got = await stream(s, url, "", _ids(rng, prompt), tokens)
            ttft.append(got.ttft_s)
            itl.append(statistics.median(got.itl_s))
    return {"ttft_ms": statistics.median(ttft) * 1e3, "itl_ms": statistics.median(itl) * 1e3}


async def submit_batch(url: str, args: argparse.Namespace, log_dir: Path) -> str:
    rng = random.Random(5)
    path = log_dir / "batch.jsonl"
    with open(path, "w") as f:
        for i in range(args.lines):
            body = {"model": MODEL, "prompt": _ids(rng, args.line_prompt), "max_tokens": args.line_tokens,
                    "temperature": 0, "ignore_eos": True}
            f.write(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")
    async with aiohttp.ClientSession() as s:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", path.read_bytes(), filename="batch.jsonl")
        async with s.post(url + "/v1/files", data=form) as r:
            file_id = (await r.json())["id"]
        async with s.post(url + "/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                                     "completion_window": "24h"}) as r:
            return (await r.json())["id"]


async def batch_state(url: str, batch_id: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/v1/batches/{batch_id}") as r:
        return await r.json()


def part_batch(args: argparse.Namespace, log_dir: Path) -> dict:
    up = ["--model", args.model, "--device", "cpu", "--no-redis", "--colocated", "--served-model-name", MODEL,
          f"--router-arg=--files-dir={log_dir / 'files'}", f"--worker-arg=--max-num-seqs={args.max_num_seqs}",
          "--worker-arg=--speculative=off", *(f"--router-arg={a}" for a in args.router_arg)]
    out: dict = {}
    with Stack("batch", up, log_dir) as st:
        st.wait_ready()
        asyncio.run(interactive(st.url, 2, args.quiet_prompt, args.quiet_tokens, 0))  # warm-up
        out["alone, before the batch"] = asyncio.run(interactive(st.url, args.quiet_requests, args.quiet_prompt,
                                                                 args.quiet_tokens, 1))
        batch_id = asyncio.run(submit_batch(st.url, args, log_dir))
        t0 = time.perf_counter()
        while (before := asyncio.run(batch_state(st.url, batch_id))["request_counts"]["completed"]) \
                < args.batch_warmup_lines:
            time.sleep(0.5)
        t1 = time.perf_counter()
        out["beside the batch"] = asyncio.run(interactive(st.url, args.quiet_requests, args.quiet_prompt,
                                                          args.quiet_tokens, 2))
        state = asyncio.run(batch_state(st.url, batch_id))
        out["beside the batch"]["batch_completed_while_measuring"] = state["request_counts"]["completed"]
        # (the batch's own pace while interactive requests were there: it yields to them, --batch-busy-concurrency)
        out["beside the batch"]["batch_lines_per_s_meanwhile"] = (state["request_counts"]["completed"] - before) / (
            time.perf_counter() - t1)
        while state["status"] not in ("completed", "failed", "cancelled", "expired"):
            time.sleep(1.0)
            state = asyncio.run(batch_state(st.url, batch_id))
        elapsed = time.perf_counter() - t0
        out["alone, after the batch"] = asyncio.run(interactive(st.url, args.quiet_requests, args.quiet_prompt,
                                                                args.quiet_tokens, 3))
        out["batch"] = {"status": state["status"], "lines": state["request_counts"]["total"],
                        "completed": state["request_counts"]["completed"], "seconds": elapsed,
                        "lines_per_s": state["request_counts"]["completed"] / elapsed}
    return out


async def closed_loop(url: str, route: str, clients: int, duration: float, tokens: int) -> int:
    """Streams through `route` for `duration` seconds; the completion tokens streamed."""
    msgs = [{"role": "user", "content": "Count slowly to one hundred"}]
    if route == "chat":
        path, body = "/v1/chat/completions", {"model": "tiny", "messages": msgs, "max_tokens": tokens, "stream": True,
                                              "ignore_eos": True, "stream_options": {"include_usage": True}}
    else:
        path, body = "/v1/messages", {"model": "tiny", "messages": msgs, "max_tokens": tokens, "stream": True}
    done = 0
    stop = time.perf_counter() + duration
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def client() -> None:
            nonlocal done
            while time.perf_counter() < stop:
                async with s.post(url + path, json=body) as r:
                    raw = await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"{r.status}: {raw[:300]!r}")
                for line in raw.splitlines():
                    if line.startswith(b"data: {") and b'"output_tokens"' in line and b"message_delta" in line:
                        done += json.loads(line[6:])["usage"]["output_tokens"]
                    elif line.startswith(b"data: {") and b'"completion_tokens"' in line and b'"choices":[]' in line:
                        done += json.loads(line[6:])["usage"]["completion_tokens"]

        await asyncio.gather(*(client() for _ in range(clients)))
    return done


def part_messages(args: argparse.Namespace, log_dir: Path) -> dict[str, float]:
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_model import make_tiny_llama

    model = make_tiny_llama(log_dir / "tiny")
    procs: list[subprocess.Popen] = []
    try:
        w_port, m_port, r_port = free_port(), free_port(), free_port()
        procs.append(spawn(["-m", "splitfire_cli", "serve", "--model", str(model), "--device", "cpu", "--host",
                            "127.0.0.1", "--grpc-port", str(w_port), "--metrics-port", str(m_port),
                            "--kv-cache-gb", "0.05", "--max-num-seqs", "64"], "worker ready", log_dir / "worker.log"))
        router = spawn(["-m", "splitfire_cli", "router", "--model", str(model), "--served-model-name", "tiny",
                        "--colocated", f"127.0.0.1:{w_port}", "--host", "127.0.0.1", "--port", str(r_port)],
                       "router ready", log_dir / "router.log")
        procs.append(router)
        url = f"http://127.0.0.1:{r_port}"
        for route in ("chat", "messages"):
            asyncio.run(closed_loop(url, route, 4, 1.0, args.tokens))
        per_token: dict[str, list[float]] = {"chat": [], "messages": []}
        for _ in range(args.rounds):
            for route in per_token:
                c0 = cpu_seconds(router.pid)
                n = asyncio.run(closed_loop(url, route, args.clients, args.seconds, args.tokens))
                per_token[route].append((cpu_seconds(router.pid) - c0) / max(n, 1) * 1e6)
        return {k: statistics.median(v) for k, v in per_token.items()}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="batch,messages")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--lines", type=int, default=1000)
    p.add_argument("--line-prompt", type=int, default=64)
    p.add_argument("--line-tokens", type=int, default=16)
    p.add_argument("--batch-warmup-lines", type=int, default=20, help="lines done before measuring beside it")
    p.add_argument("--quiet-prompt", type=int, default=64)
    p.add_argument("--quiet-tokens", type=int, default=16)
    p.add_argument("--quiet-requests", type=int, default=12)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--tokens", type=int, default=64, help="part 2: tokens per stream")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--router-arg", action="append", default=[],
                   help="part 1: a router flag, e.g. --router-arg=--batch-busy-concurrency=0 (repeatable)")
    p.add_argument("--json", default="")
    args = p.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="bench-batch-"))
    results: dict = {"machine": cpu_flags()}
    print(results["machine"], flush=True)
    if "batch" in args.parts:
        rows = part_batch(args, log_dir)
        results["batch"] = rows
        alone = rows["alone, before the batch"]["ttft_ms"]
        b = rows["batch"]
        print(f"\nInteractive requests ({args.quiet_prompt} -> {args.quiet_tokens} tokens, one at a time, "
              f"{args.quiet_requests} each) beside a batch of {b['lines']} lines ({args.line_prompt} -> "
              f"{args.line_tokens} tokens; {args.model}, 1 colocated worker)")
        print(f"{'interactive':<28}{'TTFT p50 ms':>13}{'x alone':>9}{'ITL p50 ms':>12}")
        for label in ("alone, before the batch", "beside the batch", "alone, after the batch"):
            r = rows[label]
            print(f"{label:<28}{r['ttft_ms']:>13.1f}{r['ttft_ms'] / alone:>9.2f}{r['itl_ms']:>12.1f}")
        print(f"batch: {b['status']}, {b['completed']}/{b['lines']} lines in {b['seconds']:.0f} s "
              f"({b['lines_per_s']:.1f} lines/s; {rows['beside the batch']['batch_lines_per_s_meanwhile']:.1f} lines/s "
              "while the interactive requests ran)")
    if "messages" in args.parts:
        cpu = part_messages(args, log_dir)
        results["router_us_per_token"] = cpu
        print(f"\nRouter CPU per streamed token (tiny model, {args.clients} streams of {args.tokens} tokens, medians of "
              f"{args.rounds} alternating rounds)")
        print(f"{'route':<24}{'CPU us/token':>14}{'vs chat':>10}")
        for label, us in cpu.items():
            print(f"{label:<24}{us:>14.1f}{us / cpu['chat']:>10.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    shutil.rmtree(log_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
