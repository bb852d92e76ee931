"""Fault injection against a cluster this script starts itself: 1 prefill + 2 decode workers
(remote prefill always), a router, and Redis when `redis-server` is installed.

    python -m loadtest.chaos                       # every scenario, the tiny random model
    python -m loadtest.chaos --scenarios fuzz,slowloris

Scenarios: kill -9 a decode worker mid-stream; kill -9 the prefill worker mid-prefill; a storm
of clients that leave while their long prompts are queued or prefilling; Redis outage; overload
(a router with 2 slots + 2 queued); slowloris (200 connections that never finish a request head);
SIGTERM drain with new arrivals; restart of a killed worker on its address (time until the router
routes to it again); 500 fuzzed bodies. One table: requests, ok, clean errors (4xx and 429 with an
OpenAI error body, clients that left, and in the overload scenario the full fleet's 503 no_capacity with
Retry-After), 5xx (any other, 503 included: a healthy worker was always there), hangs, leaked KV blocks,
engine steps run after the clients left, and time to re-admit.

Targets: 0 server errors while a healthy worker exists, 0 hangs, 0 leaked blocks, <= ~1 step of
wasted compute per cancelled request, a restarted worker routed to <= 3 s after it is ready.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc

from loadtest import fuzz
from loadtest.stack import ROOT, free_port
from protos import splitfire_pb2 as pb
from protos import splitfire_pb2_grpc as pbg

MODEL = "tiny"


@dataclass
class Proc:
    """One process of the cluster, restartable on the same ports."""

    name: str
    args: list[str]
    log_dir: Path
    ready: str
    ports: dict[str, int] = field(default_factory=dict)
    popen: subprocess.Popen | None = None

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def start(self, timeout: float = 120) -> float:
        """Starts and waits until ready; returns the time it became ready (monotonic)."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "MC_LOG_LEVEL": "ERROR",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        f = open(self.log_path, "a")
        argv = self.args if not self.args[0].startswith("-") else [sys.executable, *self.args]
        self.popen = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                      start_new_session=True)
        start = self.log_path.stat().st_size
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready in self.log_path.read_text(errors="replace")[start:]:
                return time.monotonic()
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} not ready in {timeout}s")

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)

    def terminate(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        self.terminate()
        if self.popen is not None:
            try:
                self.popen.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.ports['grpc']}"


def worker(role: str, model: Path, log_dir: Path, name: str, *extra: str) -> Proc:
    ports = {"grpc": free_port(), "metrics": free_port()}
    cmd = {"prefill": "prefill", "decode": "decode"}[role]
    args = ["-m", "splitfire_cli", cmd, "--model", str(model), "--device", "cpu", "--host", "127.0.0.1",
            "--grpc-port", str(ports["grpc"]), "--metrics-port", str(ports["metrics"]), "--kv-cache-gb", "0.02",
            "--threads", "1", "--mooncake-host", "127.0.0.1", *extra]
    return Proc(name, args, log_dir, "worker ready", ports)


def router(model: Path, log_dir: Path, name: str, prefill: Proc, decodes: list[Proc], *extra: str) -> Proc:
    port = free_port()
    args = ["-m", "splitfire_cli", "router", "--model", str(model), "--served-model-name", MODEL, "--host",
            "127.0.0.1", "--port", str(port), "--health-interval", "0.5", "--prefill", prefill.grpc,
            "--decode", *(d.grpc for d in decodes), *extra]
    return Proc(name, args, log_dir, "router ready", {"http": port})


@dataclass
class Row:
    scenario: str
    requests: int = 0
    ok: int = 0
    clean_errors: int = 0
    server_errors: int = 0
    hangs: int = 0
    leaked_blocks: int = 0
    wasted_steps: float | None = None  # engine steps run for requests whose clients had left, per request
    readmit_s: float | None = None
    notes: list[str] = field(default_factory=list)

    def count(self, status: int | None, full_is_clean: bool = False) -> None:
        """`full_is_clean`: a 503 is the answer this scenario asks for (the fleet is full: no_capacity)."""
        self.requests += 1
        if status is None:
            self.hangs += 1
        elif status == 200:
            self.ok += 1
        elif status >= 500 and not (full_is_clean and status == 503):  # a healthy worker could have served
            self.server_errors += 1
        else:
            self.clean_errors += 1


class Chaos:
    def __init__(self, model: Path, log_dir: Path):
        self.model, self.log_dir = model, log_dir
        self.prefill = worker("prefill", model, log_dir, "prefill", "--max-num-batched-tokens", "16",
                              "--max-num-seqs", "16")
        self.decodes = [worker("decode", model, log_dir, f"decode{i}", "--local-prefill-max-tokens", "0",
                               "--kv-quarantine", "0.5") for i in range(2)]
        self.redis: subprocess.Popen | None = None
        self.redis_port = 0
        extra: list[str] = []
        if shutil.which("redis-server"):
            self.redis_port = free_port()
            extra = ["--redis-url", f"redis://127.0.0.1:{self.redis_port}/0"]
        self.router = router(model, log_dir, "router", self.prefill, self.decodes, "--keepalive-timeout", "2",
                             "--policy", "round_robin", *extra)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.router.ports['http']}"

    def start(self) -> None:
        if self.redis_port:
            self.redis = subprocess.Popen(["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1",
                                           "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL,
                                          start_new_session=True)
        for p in (self.prefill, *self.decodes, self.router):
            p.start()

    def stop(self) -> None:
        for p in (self.router, *self.decodes, self.prefill):
            p.stop()
        if self.redis is not None and self.redis.poll() is None:
            self.redis.kill()

    # -- measuring ------------------------------------------------------------------------

    async def ask(self, s: aiohttp.ClientSession, *, tokens: int = 16, words: int = 8, session: str = "",
                  url: str = "", timeout: float = 60, stream: bool = True, tag: str = "") -> tuple[int | None, int, str]:
        """(status or None on a hang, completion tokens, decode worker that served). `tag` starts the
        prompt, so tagged prompts share no cached prefix."""
        content = (tag + " " if tag else "") + " ".join(["word"] * words)
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
                "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": stream,
                **({"stream_options": {"include_usage": True}} if stream else {})}
        headers = {"x-session-affinity": session} if session else {}
        try:
            async with asyncio.timeout(timeout):
                async with s.post((url or self.url) + "/v1/chat/completions", json=body, headers=headers) as r:
                    raw = await r.read()
                    if r.status >= 500:
                        print(f"  {r.status}: {raw[:300]!r}", file=sys.stderr, flush=True)
                    n = 0
                    if r.status == 200:
                        for line in raw.split(b"\n"):
                            if line.startswith(b"data: {"):
                                obj = json.loads(line[6:])
                                if obj.get("usage"):
                                    n = obj["usage"]["completion_tokens"]
                                if "error" in obj:  # the stream began, then failed
                                    print(f"  stream error: {obj['error']}", file=sys.stderr, flush=True)
                                    return 502, 0, ""
                        if not stream:
                            n = json.loads(raw)["usage"]["completion_tokens"]
                    return r.status, n, r.headers.get("X-Splitfire-Decode", "")
        except TimeoutError:
            return None, 0, ""

    @staticmethod
    async def stats(p: Proc) -> pb.StatsResponse:
        async with grpc.aio.insecure_channel(p.grpc) as ch:
            return await pbg.WorkerStub(ch).Stats(pb.StatsRequest(), timeout=5)

    async def leaked(self, settle_s: float = 5.0) -> int:
        """KV blocks still held by live workers once nothing is running (after quarantines)."""
        deadline = time.monotonic() + settle_s
        while True:
            held = 0
            for p in (self.prefill, *self.decodes):
                if p.popen is not None and p.popen.poll() is None:
                    st = await self.stats(p)
                    held += st.kv_blocks_used + st.reserved
            if held == 0 or time.monotonic() > deadline:
                return held
            await asyncio.sleep(0.1)

    @staticmethod
    def steps(p: Proc) -> float:
        import urllib.request

        body = urllib.request.urlopen(f"http://127.0.0.1:{p.ports['metrics']}/metrics", timeout=5).read().decode()
        m = re.search(r"^splitfire_worker_step_seconds_count\{[^}]*\} ([0-9.e+]+)$", body, re.M)
        return float(m.group(1)) if m else 0.0

    async def until(self, check: Callable[[], Awaitable[bool]], timeout: float = 30) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await check():
                return True
            await asyncio.sleep(0.02)
        return False

    async def readmit(self, s: aiohttp.ClientSession, p: Proc) -> float:
        """Restart a killed worker on its address; seconds from ready until a request lands on it."""
        ready = await asyncio.to_thread(p.start)
        while time.monotonic() - ready < 30:
            _, _, served = await self.ask(s, tokens=2)
            if served == p.grpc:
                return time.monotonic() - ready
            await asyncio.sleep(0.05)
        return float("inf")

    # -- scenarios --------------------------------------------------------------------------

    async def kill_decode_mid_stream(self, s: aiohttp.ClientSession, row: Row) -> None:
        victim = self.decodes[0]
        tasks = [asyncio.create_task(self.ask(s, tokens=96)) for _ in range(8)]
        await self.until(lambda: self._decoding(victim))
        victim.kill()
        for status, n, _ in await asyncio.gather(*tasks):
            row.count(status if status != 200 or n == 96 else 502)
        row.readmit_s = await self.readmit(s, victim)

    async def _decoding(self, p: Proc) -> bool:
        st = await self.stats(p)
        return st.running > 0 and st.decode_tokens_remaining > 0

    async def kill_prefill_mid_prefill(self, s: aiohttp.ClientSession, row: Row) -> None:
        tasks = [asyncio.create_task(self.ask(s, tokens=8, words=300)) for _ in range(4)]

        async def prefilling() -> bool:
            return (await self.stats(self.prefill)).prompt_tokens_in_flight > 0

        await self.until(prefilling)
        self.prefill.kill()
        for status, n, _ in await asyncio.gather(*tasks):
            row.count(status if status != 200 or n == 8 else 502)
        await asyncio.to_thread(self.prefill.start)  # back for the next scenarios

    async def disconnect_storm(self, s: aiohttp.ClientSession, row: Row) -> None:
        n = 16
        before = self.steps(self.prefill)
        tasks = [asyncio.create_task(self.ask(s, tokens=8, words=440, timeout=0.25, tag=f"storm-{time.time_ns()}-{i}"))
                 for i in range(n)]  # (distinct prompts: nothing comes from a cache)
        results = await asyncio.gather(*tasks)  # each client gives up after 0.25 s
        left = self.steps(self.prefill)

        async def idle() -> bool:
            st = await self.stats(self.prefill)
            return st.running == 0 and st.waiting == 0 and st.prompt_tokens_in_flight == 0

        await self.until(idle, 30)
        await asyncio.sleep(0.3)
        gone = sum(r[0] is None for r in results)
        row.wasted_steps = (self.steps(self.prefill) - left) / max(gone, 1)
        for status, _, _ in results:
            if status is None:  # the client left: nothing to answer, not a hang
                row.requests += 1
                row.clean_errors += 1
            else:
                row.count(status)
        row.notes = [f"{gone} clients left; {left - before:.0f} prefill steps before they did"]

    async def redis_outage(self, s: aiohttp.ClientSession, row: Row) -> None:
        if self.redis is None:
            row.notes.append("skipped: no redis-server")
            return
        sessions = [f"chaos-{i}" for i in range(6)]
        first = {}
        for sess in sessions:
            status, _, served = await self.ask(s, tokens=4, session=sess)
            row.count(status)
            first[sess] = served
        self.redis.kill()
        self.redis.wait(10)
        moved = 0
        for sess in reversed(sessions):
            status, _, served = await self.ask(s, tokens=4, session=sess)
            row.count(status)
            moved += served != first[sess]
        row.notes.append(f"{moved} of {len(sessions)} sessions changed worker during the outage")

    async def overload(self, s: aiohttp.ClientSession, row: Row) -> None:
        small = router(self.model, self.log_dir, "router-small", self.prefill, self.decodes, "--max-concurrency",
                       "2", "--max-queue", "2")
        await asyncio.to_thread(small.start)
        url = f"http://127.0.0.1:{small.ports['http']}"
        try:
            results = await asyncio.gather(*(self.ask(s, tokens=48, url=url) for _ in range(16)))
            for status, _, _ in results:
                row.count(status, full_is_clean=True)
            row.notes.append(f"{sum(r[0] == 503 for r in results)} answered 503 no_capacity + Retry-After")
        finally:
            small.stop()

    async def slowloris(self, s: aiohttp.ClientSession, row: Row) -> None:
        socks = []
        for _ in range(200):
            sock = socket.create_connection(("127.0.0.1", self.router.ports["http"]))
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            socks.append(sock)
        results = await asyncio.gather(*(self.ask(s, tokens=8) for _ in range(8)))
        for status, _, _ in results:
            row.count(status)
        await asyncio.sleep(3.0)  # the router's --keepalive-timeout here is 2 s
        closed = 0
        for sock in socks:
            sock.setblocking(False)
            try:
                closed += sock.recv(1) == b""
            except BlockingIOError:
                pass
            except OSError:
                closed += 1
            sock.close()
        row.notes.append(f"{closed} of 200 slow connections closed by the router")

    async def sigterm_drain(self, s: aiohttp.ClientSession, row: Row) -> None:
        victim = self.decodes[1]
        tasks = [asyncio.create_task(self.ask(s, tokens=64)) for _ in range(6)]
        await self.until(lambda: self._decoding(victim))
        victim.terminate()
        for _ in range(12):  # new arrivals while it drains
            tasks.append(asyncio.create_task(self.ask(s, tokens=16)))
            await asyncio.sleep(0.05)
        for status, _, _ in await asyncio.gather(*tasks):
            row.count(status)
        await asyncio.to_thread(victim.popen.wait, 60)
        row.readmit_s = await self.readmit(s, victim)

    async def fuzz(self, s: aiohttp.ClientSession, row: Row) -> None:
        res = await fuzz.run(self.url, MODEL, 500, seed=11)
        row.requests = sum(res.statuses.values()) + res.hangs
        row.ok = res.statuses.get(200, 0)
        row.server_errors = sum(v for k, v in res.statuses.items() if k >= 500)
        row.clean_errors = row.requests - row.ok - row.server_errors - res.hangs
        row.hangs = res.hangs


SCENARIOS = ["kill_decode_mid_stream", "kill_prefill_mid_prefill", "disconnect_storm", "redis_outage", "overload",
             "slowloris", "sigterm_drain", "fuzz"]


async def run(chaos: Chaos, names: list[str]) -> list[Row]:
    rows = []
    # Idle pooled connections are dropped before the router's 2 s keep-alive closes them: reusing one the
    # server is closing at that moment fails the request (ServerDisconnected), which is the client's race.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(keepalive_timeout=1.0)) as s:
        for name in names:
            row = Row(name)
            await getattr(chaos, name)(s, row)
            row.leaked_blocks = await chaos.leaked()
            rows.append(row)
            print(format_row(row), flush=True)
    return rows


HEADER = (f"{'scenario':<26}{'requests':>9}{'ok':>6}{'clean err':>10}{'5xx':>5}{'hangs':>6}{'leaked':>7}"
          f"{'steps/cancel':>13}{'re-admit s':>11}  notes")


def format_row(r: Row) -> str:
    steps = f"{r.wasted_steps:.2f}" if r.wasted_steps is not None else "-"
    readmit = f"{r.readmit_s:.2f}" if r.readmit_s is not None else "-"
    return (f"{r.scenario:<26}{r.requests:>9}{r.ok:>6}{r.clean_errors:>10}{r.server_errors:>5}{r.hangs:>6}"
            f"{r.leaked_blocks:>7}{steps:>13}{readmit:>11}  {'; '.join(r.notes)}")


def tiny_model(path: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_model import make_tiny_llama

    return make_tiny_llama(path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="model directory (default: a tiny random model made now)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--logs", default="", help="where the processes' logs go (default: a temporary directory)")
    args = p.parse_args()
    names = [n for n in args.scenarios.split(",") if n]
    unknown = set(names) - set(SCENARIOS)
    if unknown:
        p.error(f"unknown scenarios {sorted(unknown)}; choose from {SCENARIOS}")
    log_dir = Path(args.logs or tempfile.mkdtemp(prefix="chaos-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else tiny_model(log_dir / "tiny")
    chaos = Chaos(model, log_dir)
    print(f"logs: {log_dir}")
    chaos.start()
    try:
        print(HEADER, flush=True)
        rows = asyncio.run(run(chaos, names))
    finally:
        chaos.stop()
    bad = [r.scenario for r in rows if r.server_errors or r.hangs or r.leaked_blocks
           or (r.readmit_s is not None and r.readmit_s > 3.0)
           or (r.wasted_steps is not None and r.wasted_steps > 1.5)]
    print("targets: 0 5xx, 0 hangs, 0 leaked blocks, <= 1.5 steps per cancelled request, re-admit <= 3 s: "
          + ("met" if not bad else f"MISSED in {bad}"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
