"""splitfire against llama.cpp's `llama-server` on the same GGUF, same machine, same load, one run.

The workload (issue #18): `/v1/completions`, distinct ~256-token prompts, 128 tokens out
(ignore_eos), greedy, streamed, a closed loop of 1 and of 16 concurrent streams. Both servers
read the same GGUF file: llama-server its native blocks, splitfire the same blocks re-expressed in
its int4/int8 layout. Nothing is built or downloaded: give the path of a `llama-server` binary
(e.g. built from the llama.cpp sources in the `llama-cpp-python` sdist on PyPI), or only
splitfire's rows are printed.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from loadtest.stack import Stack, free_port
from loadtest.workload import WORDS, pct, sse_events

PROMPT_WORDS = 255  # ~256 SmolLM2 tokens
MAX_TOKENS = 128


@dataclass
class Stream:
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None


@dataclass
class Row:
    server: str
    streams: int
    output_tok_s: float
    ttft_p50: float
    itl_p50: float
    itl_p99: float
    requests: int
    errors: int
    error_sample: str | None = None


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(PROMPT_WORDS))


async def _one(session: aiohttp.ClientSession, url: str, model: str, text: str) -> Stream:
    s = Stream()
    body = {"model": model, "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True}
    t0 = time.perf_counter()
    last = None
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                s.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return s
            async for obj in sse_events(resp):
                if "error" in obj:
                    s.error = str(obj["error"])[:200]
                    break
                if not obj.get("choices") or not obj["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                if last is None:
                    s.ttft = now - t0
                else:
                    s.gaps.append(now - last)
                last = now
                s.tokens += 1
    except (aiohttp.ClientError, TimeoutError) as e:
        s.error = f"{type(e).__name__}: {e}"
    return s


async def closed_loop(url: str, model: str, streams: int, duration_s: float, seed: int) -> tuple[list[Stream], float]:
    """`streams` clients, each sending its next request as soon as the last one ends, for `duration_s`
    (requests under way at the end are finished and counted)."""
    rng = random.Random(seed)
    results: list[Stream] = []
    # A fresh connection per request: llama-server closes idle keep-alive connections, and a pooled
    # one it closed fails the next request's write (counted as an error, not a server's fault).
    conn = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=900)) as session:
        t0 = time.perf_counter()

        async def client() -> None:
            while time.perf_counter() - t0 < duration_s:
                results.append(await _one(session, url, model, prompt(rng)))

        await asyncio.gather(*(client() for _ in range(streams)))
        return results, time.perf_counter() - t0


def summarize(server: str, streams: int, results: list[Stream], wall: float) -> Row:
    ok = [r for r in results if r.error is None and r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps]
    failed = [r.error or "no token streamed" for r in results if r.error is not None or r.ttft is None]
    return Row(server, streams, sum(r.tokens for r in ok) / wall, pct([r.ttft for r in ok], 50), pct(gaps, 50),
               pct(gaps, 99), len(results), len(failed), failed[0] if failed else None)


class LlamaServer:
    """`llama-server` on the GGUF with `slots` parallel slots, 2 threads, context for all of them."""

    def __init__(self, binary: str, gguf: Path, slots: int, threads: int, log: Path):
        self.port = free_port()
        ctx = slots * (512 + MAX_TOKENS)
        self._log = open(log, "w")
        self.proc = subprocess.Popen(
            [binary, "-m", str(gguf), "--port", str(self.port), "--host", "127.0.0.1", "-np", str(slots),
             "-c", str(ctx), "-t", str(threads), "-tb", str(threads), "--no-webui"],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}; see {self._log.name}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise TimeoutError("llama-server not ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()


def _measure(url: str, model: str, name: str, levels: list[int], duration_s: float) -> list[Row]:
    rows = []
    asyncio.run(closed_loop(url, model, 1, 3.0, seed=99))  # warm-up: first-request costs out of the rows
    for n in levels:
        results, wall = asyncio.run(closed_loop(url, model, n, duration_s, seed=n))
        rows.append(summarize(name, n, results, wall))
        print(f"  {name} x{n}: {rows[-1].output_tok_s:.1f} tok/s", flush=True)
    return rows


def run_llama_server(binary: str, gguf: Path, levels: list[int], duration_s: float, log_dir: Path) -> list[Row]:
    srv = LlamaServer(binary, gguf, max(levels), 2, log_dir / "llama-server.log")
    try:
        srv.wait_ready()
        return _measure(srv.url, "model", "llama-server", levels, duration_s)
    finally:
        srv.stop()


def run(gguf: Path, llama_server: str | None, levels: list[int], duration_s: float, log_dir: Path,
        splitfire_args: list[str], label: str = "splitfire") -> list[Row]:
    rows: list[Row] = run_llama_server(llama_server, gguf, levels, duration_s, log_dir) if llama_server else []
    with Stack(label, ["--colocated", "--model", str(gguf), *splitfire_args], log_dir) as st:
        with urllib.request.urlopen(st.url + "/v1/models", timeout=10) as r:
            model = json.load(r)["data"][0]["id"]
        rows += _measure(st.url, model, label, levels, duration_s)
    return rows


def table(rows: list[Row]) -> str:
    """One column per server/configuration, in run order; the ratio columns compare each splitfire
    configuration with llama-server (>1: better for splitfire)."""
    by = {(r.server, r.streams): r for r in rows}
    servers = list(dict.fromkeys(r.server for r in rows))
    ours = [n for n in servers if n != "llama-server"]
    base = "llama-server" if "llama-server" in servers else None
    head = "| | " + " | ".join(servers) + (" | " + " | ".join(f"{n} / llama-server" for n in ours) if base else "") + " |"
    lines = [head, "|" + " --- |" + " ---: |" * (len(servers) + (len(ours) if base else 0))]
    metrics = (("output tok/s", "output_tok_s", 1, "", True), ("TTFT p50", "ttft_p50", 1000, " ms", False),
               ("inter-token p50", "itl_p50", 1000, " ms", False), ("inter-token p99", "itl_p99", 1000, " ms", False))
    for n in sorted({r.streams for r in rows}):
        for label, attr, scale, unit, higher_better in metrics:
            cells = [f"{getattr(by[(srv, n)], attr) * scale:.1f}{unit}" for srv in servers]
            if base:
                theirs = getattr(by[(base, n)], attr)
                for o in ours:
                    v = getattr(by[(o, n)], attr)
                    cells.append(f"{(v / theirs if higher_better else theirs / v):.2f}x")
            lines.append(f"| {n} stream{'s' if n > 1 else ''}: {label} | " + " | ".join(cells) + " |")
    errors = sum(r.errors for r in rows)
    lines.append(f"\n({sum(r.requests for r in rows)} requests, {errors} errors; percentiles over every request/gap "
                 "in the run)")
    for r in rows:
        if r.errors:
            lines.append(f"  {r.server} x{r.streams}: {r.errors} of {r.requests} failed, e.g. {r.error_sample}")
    return "\n".join(lines)


def main() -> int:
    """Just the HTTP comparison: llama-server, then splitfire as configured by each --config."""
    import argparse
    import tempfile

    from engine.loading.model_store import DEFAULT_MODEL, builtin_gguf

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-server", default=None, help="path of a llama-server binary (else splitfire alone)")
    p.add_argument("--gguf", default=None, help="default: the built-in SmolLM2 GGUF")
    p.add_argument("--streams", default="1,16")
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--llama-server-last", action="store_true",
                   help="measure llama-server after the splitfire configurations (the first server measured after "
                        "another one stopped has run slower on this shared VM: swap the order to see it)")
    p.add_argument("--config", action="append", default=[],
                   help="NAME=ARGS: a splitfire configuration, `splitfire up` arguments after '=' (repeatable; "
                        "default: one named splitfire with none)")
    args = p.parse_args()
    gguf = Path(args.gguf) if args.gguf else builtin_gguf(DEFAULT_MODEL)
    levels = [int(x) for x in args.streams.split(",")]
    configs = [c.split("=", 1) for c in args.config] or [["splitfire", ""]]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="vs-llama-") as logs:
        first = None if args.llama_server_last else args.llama_server
        for i, (name, extra) in enumerate(configs):
            rows += run(gguf, first if i == 0 else None, levels, args.duration, Path(logs), extra.split(), label=name)
        if args.llama_server and args.llama_server_last:
            rows += run_llama_server(args.llama_server, gguf, levels, args.duration, Path(logs))
    print(f"\n/v1/completions, ~256-token prompts, {MAX_TOKENS} tokens out, greedy, closed loop, "
          f"{args.duration:.0f} s per level, every server on this machine's CPU:")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
