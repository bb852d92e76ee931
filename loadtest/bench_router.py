"""Router overhead: the same streaming load sent directly to an upstream and through the router.

Part 1 (HTTP): an OpenAI-compatible upstream that streams 64 tokens with no delay
(`fake_upstream.py`), at concurrency 1, 16 and 64. Reports p50 TTFT direct vs routed,
the TTFT the router adds, throughput, and the router's CPU seconds per 1000 streamed chunks
(from /proc, so the load generator's own CPU is not counted), beside the CPU of a minimal
aiohttp proxy (`min_proxy.py`: the same HTTP client, no validation, placement or metrics) under
the same load — the floor for a Python router on this machine — and, as a row of its own, that proxy
on a bare asyncio.Protocol server (`--server asyncio`): the floor without aiohttp's server.

With `--vllm-router PATH` (its executable, e.g. from `pip install vllm-router` in a venv of its own):
the same load through vllm-router (Rust) in front of the same upstream, measured the same way in the
same run, as a row of its own below each HTTP row.

With `--paced-ms` (default 2): the same upstream pacing its tokens like a decode step, so each
token reaches the router in a read of its own — the per-token cost a production router pays.

Part 2 (--pd): a worker running the tiny test model, called directly over gRPC vs through the
router, which reads the worker's token stream over gRPC (`--worker-stream grpc`), over the worker's
HTTP port one stream each (`http`, length-prefixed frames), or every stream on one connection (`mux`,
the default), the last with the router's direct relay (the default) and without (`--stream-relay
queued`); same figures.

    python -m loadtest.bench_router            # ~1 minute
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from loadtest.stack import ROOT, free_port

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def pin_client() -> tuple[set[int] | None, str]:
    """The load generator gets core 0 and the servers the rest, so the generator's own CPU use
    does not count as router latency (in production the clients are on other machines).
    Returns the servers' cores (None: no pinning) and a line describing the layout."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, f"cores: {len(cpus)}, shared by load generator and servers"
    os.sched_setaffinity(0, {cpus[0]})
    return set(cpus[1:]), f"cores: load generator on {cpus[0]}, upstream/router/workers on {cpus[1:]}"


def spawn(args: list[str], ready: str, log: Path, cpus: set[int] | None = None, port: int = 0,
          env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `python *args` (or a binary, when args[0] is not a python flag), ready once `ready`
    appears in its log or, with `port`, once that port accepts connections. `env`: more variables."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SPLITFIRE_LOG_LEVEL": os.environ.get("SPLITFIRE_BENCH_LOG_LEVEL", "WARNING"),
           "PYTHONPATH": str(ROOT), "MC_LOG_LEVEL": "ERROR", **(env or {})}
    f = open(log, "w")
    argv = [sys.executable, *args] if args[0].startswith("-") else args
    p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                         preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    deadline = time.monotonic() + 120

    def is_ready() -> bool:
        if port:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0
        return ready in log.read_text(errors="replace")

    while not is_ready():
        if p.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{args[:3]} failed to start:\n{log.read_text()[-2000:]}")
        time.sleep(0.1)
    return p


async def _load(concurrency: int, duration: float, max_tokens: int, one_stream) -> dict:
    """Closed loop: `concurrency` clients each run `one_stream()` back to back for `duration`.
    `one_stream` yields once per streamed event that carries content."""
    ttfts: list[float] = []
    events = 0
    stop = time.perf_counter() + duration

    async def client() -> None:
        nonlocal events
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            first = True
            async for _ in one_stream():
                if first:
                    ttfts.append(time.perf_counter() - t0)
                    first = False
                events += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    # Upstream chunks = tokens (max_tokens per request); the router may merge them into fewer events.
    return {"ttft_p50": statistics.median(ttfts), "requests": len(ttfts), "chunks": len(ttfts) * max_tokens,
            "events": events, "rps": len(ttfts) / wall}


async def http_load(url: str, concurrency: int, duration: float, model: str, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
            "stream": True, "temperature": 0, "ignore_eos": True}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def one_stream():
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    if line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line:
                        yield

        return await _load(concurrency, duration, max_tokens, one_stream)


async def grpc_load(address: str, concurrency: int, duration: float, max_tokens: int) -> dict:
    import grpc

    from protos import splitfire_pb2 as pb
    from protos import splitfire_pb2_grpc as pbg

    req = pb.GenerateRequest(token_ids=[5, 6, 7, 8], sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True))
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pbg.DecodeStub(ch)

        async def one_stream():
            async for ev in stub.Generate(req):
                if ev.token_ids:
                    yield

        return await _load(concurrency, duration, max_tokens, one_stream)


def row(label: str, c: int, direct: dict, routed: dict, cpu: float, floor: tuple[dict, float] | None = None) -> str:
    added = (routed["ttft_p50"] - direct["ttft_p50"]) * 1000
    per_k = cpu / routed["chunks"] * 1000 if routed["chunks"] else float("nan")
    floor_k = f"{floor[1] / floor[0]['chunks'] * 1000:>12.4f}" if floor and floor[0]["chunks"] else f"{'-':>12}"
    return (f"{label:<22}{c:>4}{direct['ttft_p50'] * 1000:>12.2f}{routed['ttft_p50'] * 1000:>12.2f}{added:>10.2f}"
            f"{direct['rps']:>11.1f}{routed['rps']:>11.1f}{per_k:>14.4f}{floor_k}")


def measure(url: str, proc: subprocess.Popen, c: int, duration: float, model: str) -> tuple[dict, float]:
    """One closed-loop run against `url`: the load figures and `proc`'s CPU seconds during it."""
    cpu0 = cpu_seconds(proc.pid)
    result = asyncio.run(http_load(url, c, duration, model, 64))
    return result, cpu_seconds(proc.pid) - cpu0


def http_servers(upstream_args: list[str], tag: str, out: Path, cpus: set[int] | None,
                 procs: list[subprocess.Popen], vllm_router: str = "", queued_relay: bool = False) -> tuple:
    """A fake upstream, the router in front of it, and the minimal proxy in front of it (warmed up); with
    `vllm_router`, vllm-router in front of it too."""
    up = free_port()
    rp = free_port({up})  # (none of the three is bound yet: two draws can meet)
    mp = free_port({up, rp})
    procs.append(spawn(["-m", "loadtest.fake_upstream", "--port", str(up), *upstream_args], "fake upstream ready",
                       out / f"fake_upstream{tag}.log", cpus))
    router = spawn(["-m", "splitfire_cli", "router", "--host", "127.0.0.1", "--port", str(rp), "--served-model-name",
                    "fake", "--openai-upstream", f"http://127.0.0.1:{up}", "--max-concurrency", "1024"],
                   "router ready", out / f"router_http{tag}.log", cpus)
    procs.append(router)
    proxy = spawn(["-m", "loadtest.min_proxy", "--port", str(mp), "--upstream", f"http://127.0.0.1:{up}"],
                  "min proxy ready", out / f"min_proxy{tag}.log", cpus)
    procs.append(proxy)
    bp = free_port()
    bare = spawn(["-m", "loadtest.min_proxy", "--port", str(bp), "--upstream", f"http://127.0.0.1:{up}",
                  "--server", "asyncio"], "min proxy ready", out / f"min_proxy_asyncio{tag}.log", cpus)
    procs.append(bare)
    ports = [rp, mp, bp]
    queued = None
    if queued_relay:  # the same router without its direct relay (--stream-relay queued): the reference path
        qp = free_port()
        queued = spawn(["-m", "splitfire_cli", "router", "--host", "127.0.0.1", "--port", str(qp), "--served-model-name",
                        "fake", "--openai-upstream", f"http://127.0.0.1:{up}", "--max-concurrency", "1024",
                        "--stream-relay", "queued"], "router ready", out / f"router_http_queued{tag}.log", cpus)
        procs.append(queued)
        ports.append(qp)
    other = None
    if vllm_router:
        vp = free_port()
        other = spawn([vllm_router, "--host", "127.0.0.1", "--port", str(vp), "--worker-urls",
                       f"http://127.0.0.1:{up}", "--policy", "round_robin", "--log-level", "warning",
                       "--prometheus-port", str(free_port())], "",
                      out / f"vllm_router{tag}.log", cpus, port=vp)
        procs.append(other)
        ports.append(vp)
    for port in ports:
        asyncio.run(http_load(f"http://127.0.0.1:{port}", 4, 1.0, "fake", 64))
    return (f"http://127.0.0.1:{up}", (f"http://127.0.0.1:{rp}", router), (f"http://127.0.0.1:{mp}", proxy),
            (f"http://127.0.0.1:{bp}", bare), (f"http://127.0.0.1:{ports[-1]}", other) if other else None,
            (f"http://127.0.0.1:{qp}", queued) if queued else None)


def http_row(label: str, c: int, servers: tuple, duration: float) -> str:
    """The same load direct, through the router and through the minimal proxy, as one table row (and a
    row for vllm-router when it runs, measured against the same direct run)."""
    up_url, (r_url, router), (m_url, proxy), (b_url, bare), vllm, queued = servers
    direct = asyncio.run(http_load(up_url, c, duration, "fake", 64))
    routed, cpu = measure(r_url, router, c, duration, "fake")
    out = row(label, c, direct, routed, cpu, measure(m_url, proxy, c, duration, "fake"))
    b_routed, b_cpu = measure(b_url, bare, c, duration, "fake")
    out += "\n" + row(f"{label} (asyncio floor)", c, direct, b_routed, b_cpu)
    if queued is not None:
        q_routed, q_cpu = measure(queued[0], queued[1], c, duration, "fake")
        out += "\n" + row(f"{label} (queued relay)", c, direct, q_routed, q_cpu)
    if vllm is not None:
        v_routed, v_cpu = measure(vllm[0], vllm[1], c, duration, "fake")
        out += "\n" + row(f"{label} (vllm-router)", c, direct, v_routed, v_cpu)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=8.0, help="seconds per measurement")
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--pd", action="store_true", help="also measure gRPC mode against a real decode worker")
    p.add_argument("--stream-interval", type=int, default=1, help="the worker's --stream-interval in gRPC mode")
    p.add_argument("--shared-cores", action="store_true", help="let the load generator share cores with the "
                   "servers (default: it gets a core of its own when there are at least 2)")
    p.add_argument("--paced-ms", type=float, default=2.0, help="also measure an upstream that paces its tokens this "
                   "far apart (each token its own read, as in production); 0: skip")
    p.add_argument("--paced-concurrency", type=int, default=16)
    p.add_argument("--queued-relay", action="store_true",
                   help="also measure the router with --stream-relay queued (without its direct relay)")
    p.add_argument("--vllm-router", default="", metavar="PATH",
                   help="also measure vllm-router (this executable) in front of the same upstreams")
    p.add_argument("--out", default="loadtest/results")
    args = p.parse_args()
    if args.paced_ms > 0 and args.paced_concurrency < 1:
        p.error("--paced-concurrency must be at least 1 (--paced-ms 0 skips the paced measurement)")
    if args.shared_cores:
        cpus, layout = None, f"cores: {len(os.sched_getaffinity(0))}, all shared"
    else:
        cpus, layout = pin_client()
    print(layout)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    levels = [int(c) for c in args.concurrency.split(",")]
    procs: list[subprocess.Popen] = []
    print(f"{'mode':<22}{'conc':>4}{'TTFT direct':>12}{'TTFT router':>12}{'added ms':>10}{'req/s dir':>11}"
          f"{'req/s rtr':>11}{'CPU s/1k chk':>14}{'floor s/1k':>12}")
    try:
        servers = http_servers([], "", out, cpus, procs, args.vllm_router, args.queued_relay)
        for c in levels:
            print(http_row("http", c, servers, args.duration), flush=True)
        if args.paced_ms > 0:
            # Production-shaped: a real upstream's tokens arrive one decode step apart, so every
            # token is a network read and a client write of its own; no batching of reads.
            paced = http_servers(["--token-interval-ms", str(args.paced_ms)], "_paced", out, cpus, procs,
                                 args.vllm_router, args.queued_relay)
            print(http_row(f"http {args.paced_ms:g}ms", args.paced_concurrency, paced, args.duration), flush=True)
        if args.pd:
            import tempfile

            sys.path.insert(0, str(ROOT / "tests"))
            from tiny_model import make_tiny_llama

            model = make_tiny_llama(Path(tempfile.mkdtemp()) / "tiny")
            w_port = free_port()
            procs.append(spawn(["-m", "splitfire_cli", "serve", "--model", str(model), "--host", "127.0.0.1",
                                "--grpc-port", str(w_port), "--metrics-port", str(free_port({w_port})),
                                "--kv-cache-gb", "0.05", "--max-num-seqs", "128", "--max-num-batched-tokens", "1024",
                                "--stream-interval", str(args.stream_interval)],
                               "worker ready", out / "worker.log", cpus))
            # The same worker behind four routers: token streams read over gRPC, over the worker's HTTP
            # port one stream each (length-prefixed frames), and all on one connection (mux, the default)
            # with the router's direct relay (the default) and without it.
            routers = {}
            for label, flags in (("grpc", ["--worker-stream", "grpc"]), ("http", ["--worker-stream", "http"]),
                                 ("mux queued", ["--worker-stream", "mux", "--stream-relay", "queued"]),
                                 ("mux", ["--worker-stream", "mux", "--stream-relay", "direct"])):
                r_port = free_port()
                r = spawn(["-m", "splitfire_cli", "router", "--host", "127.0.0.1", "--port", str(r_port), "--model",
                           str(model), "--served-model-name", "tiny", "--colocated", f"127.0.0.1:{w_port}",
                           "--max-concurrency", "1024", *flags], "router ready",
                          out / f"router_{label.replace(' ', '_')}.log", cpus)
                procs.append(r)
                routers[label] = (f"http://127.0.0.1:{r_port}", r)
                asyncio.run(http_load(f"http://127.0.0.1:{r_port}", 4, 1.0, "tiny", 64))
            for c in levels:
                direct = asyncio.run(grpc_load(f"127.0.0.1:{w_port}", c, args.duration, 64))
                for transport, (url, r) in routers.items():
                    routed, cpu = measure(url, r, c, args.duration, "tiny")
                    print(row(f"pd {transport}", c, direct, routed, cpu), flush=True)
    finally:
        for pr in procs:
            pr.terminate()
            pr.wait(20)
    print("\ntargets: added p50 TTFT <= 0.5 ms at concurrency 1; router CPU <= 0.0075 s per 1000 chunks")
    print("floor: the same load through loadtest/min_proxy.py (aiohttp + the router's HTTP client, nothing else); "
          "asyncio floor: the same proxy on a bare asyncio.Protocol server (--server asyncio): what leaving aiohttp's "
          "server would leave")
    return 0


if __name__ == "__main__":
    sys.exit(main())
