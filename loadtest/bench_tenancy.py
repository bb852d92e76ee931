"""Tenants isolated in time: a noisy neighbour, weighted shares, and what fairness costs the router.

Part 1 (noisy neighbour): one colocated worker (`splitfire up --colocated`, SmolLM2 by default). A
flood tenant keeps `--flood` streams busy (closed loop: each sends its next request when the last
ends; `--flood-prompt`-token prompts, `--flood-tokens` tokens each); a quiet tenant sends one request
at a time (`--quiet-prompt` tokens, `--quiet-tokens` out), each after a pause of about `--quiet-think`
seconds (a person reading the last answer: a request lands at any moment of the worker's step). The quiet
tenant's TTFT and ITL (medians over its requests) alone, beside the flood with one tenant for both (first
come, first served: what splitfire did before tenants were scheduled), beside the flood as its own tenant
(fair), and in the flood's tenant at priority 0 beside the flood at priority 10 (priority: the keys' default
priorities); the last two again with no pause (back to back: each request lands just after the flood's next
step has begun, the worst moment).

Part 2 (weights): two tenants of weights 2 and 1, each with more streams than the worker's
`--max-num-seqs` (both saturating), for `--weights-seconds`: completion tokens each streamed in that
window, and their ratio.

Part 3 (router CPU): a router in front of a zero-cost upstream (`fake_upstream.py`) at `--router-rate`
requests/s on a fixed schedule (the same offered load for every router: CPU per request at a load is what
sizes a router; `--router-rate 0`: closed loop with more clients than `--max-concurrency`, where each
router's own speed moves its batching and a round's ratio spreads 0.95-1.35 on 2 cores): router CPU-microseconds per
request with no keys, with keys (weights and quotas counted in memory), and with keys and quotas in
Redis, and with no keys and every request traced (OpenTelemetry, 100% sampled, exported over OTLP to a
collector in this process: `loadtest/otlp_sink.py`); beside the router of `--baseline-ref` (a git ref,
checked out into a temporary worktree: "today's" router before tenancy), when given; with `--tracing-parts`,
traced routers whose spans are never queued, and encoded but never exported (where tracing's cost goes).
Rounds alternate; medians.

    python -m loadtest.bench_tenancy                      # all three parts, ~15 minutes on 2 cores
    python -m loadtest.bench_tenancy --parts router --baseline-ref 47ec1e8
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
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from loadtest.bench_host import cpu_flags
from loadtest.bench_router import cpu_seconds, spawn
from loadtest.otlp_sink import OTLPSink
from loadtest.stack import ROOT, Stack, free_port

MODEL = "bench"
KEYS = {
    "sk-flood": {"tenant": "flood"},
    "sk-quiet-as-flood": {"tenant": "flood"},  # the quiet requests, in the flood's tenant (first come, first served)
    "sk-quiet": {"tenant": "quiet"},
    "sk-flood-batch": {"tenant": "flood", "priority": 10},  # the flood as batch work
    "sk-quiet-urgent": {"tenant": "flood", "priority": 0},  # the quiet requests, urgent, in the flood's tenant
    "sk-heavy": {"tenant": "heavy", "weight": 2},
    "sk-light": {"tenant": "light", "weight": 1},
}


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(200, 40000) for _ in range(n)]


@dataclass
class Stream:
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    tokens: list[tuple[float, int]] = field(default_factory=list)  # (arrival, completion tokens so far)


async def stream(session: aiohttp.ClientSession, url: str, key: str, prompt: list[int], max_tokens: int,
                 sink: list[tuple[float, int]] | None = None) -> Stream:
    """One streamed completion; with `sink`, (arrival, new completion tokens) of every event."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    out = Stream()
    t0 = time.perf_counter()
    last = None
    async with session.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {(await r.text())[:300]}")
        async for line in r.content:
            if not line.startswith(b"data: {") or b'"text":""' in line:
                continue
            now = time.perf_counter()
            if last is None:
                out.ttft_s = now - t0
            else:
                out.itl_s.append(now - last)
            last = now
            obj = json.loads(line[6:])
            if obj.get("usage"):
                n = obj["usage"]["completion_tokens"]
                if sink is not None:
                    sink.append((now, n - (out.tokens[-1][1] if out.tokens else 0)))
                out.tokens.append((now, n))
    return out


async def flood(url: str, key: str, streams: int, prompt: int, tokens: int, stop: asyncio.Event, seed: int,
                sink: list[tuple[float, int]] | None = None, itl: list[float] | None = None) -> None:
    rng = random.Random(seed)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as s:
        async def one() -> None:
            while not stop.is_set():
                got = await stream(s, url, key, _ids(rng, prompt), tokens, sink)
                if itl is not None:
                    itl.extend(got.itl_s)

        tasks = [asyncio.create_task(one()) for _ in range(streams)]
        await stop.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def quiet_run(url: str, key: str, args: argparse.Namespace, seed: int,
                    think: float | None = None) -> dict[str, float]:
    """The quiet tenant's requests, one at a time, each after a pause drawn uniformly from 0.5-1.5x `think`
    seconds (`--quiet-think`: a person reading the last answer, so a request lands at any moment of the
    worker's step); `think` 0: each the moment the last ends, which lands it just after a step has begun."""
    rng = random.Random(seed)
    think = args.quiet_think if think is None else think
    ttft, itl = [], []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as s:
        for _ in range(args.quiet_requests):
            if think:
                await asyncio.sleep(think * rng.uniform(0.5, 1.5))
            got = await stream(s, url, key, _ids(rng, args.quiet_prompt), args.quiet_tokens)
            ttft.append(got.ttft_s)
            itl.append(statistics.median(got.itl_s))
    return {"ttft_ms": statistics.median(ttft) * 1e3, "itl_ms": statistics.median(itl) * 1e3}


async def noisy_neighbour(url: str, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    rows = {"alone": await quiet_run(url, "sk-quiet-as-flood", args, 1)}
    # One tenant first: a worker schedules fairly from the moment it has seen two tenants.
    modes = args.modes.split(",")
    rows_wanted = {"fifo": ("beside the flood, one tenant (FIFO)", "sk-quiet-as-flood", "sk-flood", None),
                   "fair": ("beside the flood, own tenant (fair)", "sk-quiet", "sk-flood", None),
                   "priority": ("priority 0 beside a priority-10 flood, one tenant", "sk-quiet-urgent",
                                "sk-flood-batch", None),
                   "fair-b2b": ("beside the flood, own tenant, back to back", "sk-quiet", "sk-flood", 0.0),
                   "priority-b2b": ("priority 0 beside priority 10, back to back", "sk-quiet-urgent",
                                    "sk-flood-batch", 0.0)}
    # Every row draws prompts of its own (seeds by row), for the flood and the quiet requests: a prompt seen in
    # an earlier row would be a prefix-cache hit here (a quiet prompt with nothing to compute; a flood whose
    # prompts skip their prefill decodes more streams at once, and its steps take longer).
    for row, (label, key, flood_key, think) in enumerate((rows_wanted[m] for m in modes), start=1):
        stop = asyncio.Event()
        itl: list[float] = []
        task = asyncio.create_task(flood(url, flood_key, args.flood, args.flood_prompt, args.flood_tokens, stop,
                                         100 + row, itl=itl))
        await asyncio.sleep(args.warmup)
        itl.clear()
        rows[label] = await quiet_run(url, key, args, 200 + row, think)
        stop.set()
        await task
        rows[label]["flood_itl_ms"] = statistics.median(itl) * 1e3 if itl else float("nan")
    return rows


async def weights(url: str, args: argparse.Namespace) -> dict[str, float]:
    stop = asyncio.Event()
    got: dict[str, list[tuple[float, int]]] = {"heavy": [], "light": []}
    tasks = [asyncio.create_task(flood(url, f"sk-{t}", args.weight_streams, args.quiet_prompt, args.flood_tokens,
                                       stop, i, got[t])) for i, t in enumerate(got)]
    await asyncio.sleep(args.warmup)
    t0 = time.perf_counter()
    await asyncio.sleep(args.weights_seconds)
    t1 = time.perf_counter()
    stop.set()
    await asyncio.gather(*tasks)
    out = {t: float(sum(n for at, n in events if t0 < at <= t1)) for t, events in got.items()}
    out["ratio"] = out["heavy"] / max(out["light"], 1)
    return out


def part_stack(args: argparse.Namespace, log_dir: Path) -> tuple[dict, dict]:
    keys = log_dir / "keys.json"
    keys.write_text(json.dumps({"keys": KEYS}))
    up = ["--model", args.model, "--device", "cpu", "--no-redis", "--colocated", "--served-model-name", MODEL,
          f"--router-arg=--api-keys={keys}", f"--worker-arg=--max-num-seqs={args.max_num_seqs}",
          "--worker-arg=--speculative=off", *(f"--worker-arg={a}" for a in args.worker_arg)]
    noisy: dict = {}
    shares: dict = {}
    with Stack("tenancy", up, log_dir) as st:
        st.wait_ready()
        asyncio.run(quiet_run(st.url, "sk-quiet-as-flood", argparse.Namespace(**{**vars(args), "quiet_requests": 2}),
                              0))
        if "noisy" in args.parts:
            noisy = asyncio.run(noisy_neighbour(st.url, args))
    if "weights" in args.parts:
        # A fresh stack: the weights are the worker's first tenants.
        with Stack("tenancy-weights", up, log_dir) as st:
            st.wait_ready()
            shares = asyncio.run(weights(st.url, args))
    return noisy, shares


# -- part 3: the router's CPU per request --------------------------------------------------------


async def router_load(url: str, key: str, clients: int, duration: float, rate: float = 0.0) -> int:
    """Requests sent for `duration` seconds: `rate` per second on a fixed schedule (open loop, at most
    2 x `clients` in flight), or with `rate` 0 by `clients` each sending the next as the last ends (closed
    loop). Returns how many completed."""
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    done = 0
    start = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def one() -> None:
            nonlocal done
            async with s.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
                if r.status != 200:
                    raise RuntimeError(f"{r.status}: {await r.text()}")
                await r.read()
            done += 1

        if not rate:
            async def client() -> None:
                while time.perf_counter() < start + duration:
                    await one()

            await asyncio.gather(*(client() for _ in range(clients)))
            return done
        room = asyncio.Semaphore(2 * clients)

        async def paced() -> None:
            async with room:
                await one()

        sent: list[asyncio.Task] = []
        for i in range(int(duration * rate)):
            wait = start + i / rate - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            sent.append(asyncio.create_task(paced()))
        await asyncio.gather(*sent)
    return done


def part_router(args: argparse.Namespace, log_dir: Path) -> dict[str, tuple[float, float]]:
    """Per router variant: (median CPU us/request, median of its per-round ratio to the first variant)."""
    procs: list[subprocess.Popen] = []
    worktree = None
    sinks = {"OTLP/gRPC": OTLPSink(keep=False).start(),
             "OTLP/HTTP": OTLPSink(keep=False, protocol="http/protobuf").start()}
    try:
        up = free_port()
        procs.append(spawn(["-m", "loadtest.fake_upstream", "--port", str(up), "--tokens", "8"], "fake upstream ready",
                           log_dir / "fake_upstream.log"))
        rport = free_port()
        procs.append(spawn(["redis-server", "--port", str(rport), "--bind", "127.0.0.1", "--save", "",
                            "--appendonly", "no"], "Ready to accept connections", log_dir / "redis.log"))
        limits = {"requests_per_minute": 10**9, "tokens_per_minute": 10**12, "max_concurrent": 10**6}
        keys = log_dir / "router_keys.json"
        keys.write_text(json.dumps({"keys": {"sk-a": {"tenant": "a", "weight": 2, **limits},
                                             "sk-b": {"tenant": "b", **limits}}}))
        base = ["--host", "127.0.0.1", "--served-model-name", "fake", "--openai-upstream", f"http://127.0.0.1:{up}",
                "--max-concurrency", str(args.router_clients // 2), "--max-queue", "100000"]
        # (the SDK's default batching: a batch of up to 512 spans every 5 s)
        traced = {name: {k: v for k, v in sink.env().items() if k != "OTEL_BSP_SCHEDULE_DELAY"}
                  for name, sink in sinks.items()}
        variants: dict[str, tuple[list[str], str, Path, dict[str, str]]] = {
            "no keys": ([], "", ROOT, {}),
            "keys, quotas in memory": (["--api-keys", str(keys)], "sk-a", ROOT, {}),
            "keys, quotas in Redis": (["--api-keys", str(keys), "--redis-url", f"redis://127.0.0.1:{rport}/0"],
                                      "sk-a", ROOT, {}),
            **{f"no keys, traced (100% sampled, {name})": ([], "", ROOT, env) for name, env in traced.items()},
        }
        if args.tracing_parts:  # where tracing's cost goes: spans made but never queued; also encoded, never exported
            http = traced["OTLP/HTTP"]
            variants["no keys, traced, spans never queued"] = ([], "", ROOT, {**http, "OTEL_BSP_MAX_QUEUE_SIZE": "0"})
            variants["no keys, traced, spans encoded, never exported"] = ([], "", ROOT, {
                **http, "OTEL_BSP_MAX_QUEUE_SIZE": str(10**9), "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": str(10**9),
                "OTEL_BSP_SCHEDULE_DELAY": str(10**9)})
        if args.baseline_ref:
            worktree = Path(tempfile.mkdtemp(prefix="bench-tenancy-base-"))
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(worktree), args.baseline_ref],
                           check=True, capture_output=True)
            variants = {f"before tenancy ({args.baseline_ref}), no keys": ([], "", worktree, {}), **variants}
        routers = {}
        for label, (extra, key, root, env) in variants.items():
            port = free_port()
            argv = ["-m", "splitfire_cli", "router", *base, "--port", str(port), *extra]
            if root != ROOT:  # the baseline's own code, not ours
                argv = ["-c", f"import sys; sys.path.insert(0, {str(root)!r}); sys.argv = ['splitfire'] + "
                              f"{argv[2:]!r}; import runpy; runpy.run_module('splitfire_cli', run_name='__main__')"]
            p = spawn(argv, "router ready", log_dir / f"router-{port}.log", env=env)
            procs.append(p)
            routers[label] = (f"http://127.0.0.1:{port}", p, key)
            asyncio.run(router_load(routers[label][0], key, 4, 1.0))
        per_request: dict[str, list[float]] = {k: [] for k in routers}
        achieved: list[float] = []  # requests/s each round reached
        for _ in range(args.router_rounds):
            for label, (url, p, key) in routers.items():
                c0, t0 = cpu_seconds(p.pid), time.perf_counter()
                n = asyncio.run(router_load(url, key, args.router_clients, args.router_seconds, args.router_rate))
                per_request[label].append((cpu_seconds(p.pid) - c0) / n * 1e6)
                achieved.append(n / (time.perf_counter() - t0))
        for name, sink in sinks.items():  # (the "never exported" router sends nothing: the HTTP sink has the other's)
            if sink.count == 0:
                raise RuntimeError(f"the router traced over {name} exported no spans")
        # (each row against the first within the same round, then the median: this VM drifts by 10% between
        # minutes, and a round's routers are measured seconds apart)
        first = next(iter(per_request.values()))
        print(f"router load: {statistics.median(achieved):.0f} requests/s (median of rounds; slowest "
              f"{min(achieved):.0f})", flush=True)
        return {k: (statistics.median(v), statistics.median(x / f for x, f in zip(v, first, strict=True)))
                for k, v in per_request.items()}
    finally:
        for sink in sinks.values():
            sink.stop()
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
        if worktree is not None:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], check=False)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="noisy,weights,router")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--flood", type=int, default=48, help="the noisy tenant's concurrent streams")
    p.add_argument("--flood-prompt", type=int, default=400)
    p.add_argument("--flood-tokens", type=int, default=128)
    p.add_argument("--quiet-prompt", type=int, default=64)
    p.add_argument("--quiet-tokens", type=int, default=16)
    p.add_argument("--quiet-requests", type=int, default=12)
    p.add_argument("--quiet-think", type=float, default=1.0,
                   help="seconds the quiet tenant pauses before each request (drawn from 0.5-1.5x this); 0: none")
    p.add_argument("--warmup", type=float, default=15.0, help="seconds of flood before measuring")
    p.add_argument("--modes", default="fifo,fair,priority,fair-b2b,priority-b2b",
                   help="part 1: the rows beside the flood (besides 'alone'): fifo, fair, priority, and fair-b2b, "
                        "priority-b2b (the quiet requests back to back, whatever --quiet-think)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--weight-streams", type=int, default=48, help="part 2: streams per tenant")
    p.add_argument("--weights-seconds", type=float, default=60.0)
    p.add_argument("--router-clients", type=int, default=32)
    p.add_argument("--router-seconds", type=float, default=5.0)
    p.add_argument("--router-rounds", type=int, default=3)
    p.add_argument("--router-rate", type=float, default=700.0,
                   help="part 3: requests/s on a fixed schedule, the same offered load for every router; 0: closed "
                        "loop (--router-clients each send the next as the last ends)")
    p.add_argument("--baseline-ref", default="", help="git ref whose router is the 'before' row of part 3")
    p.add_argument("--tracing-parts", action="store_true",
                   help="part 3: also traced routers whose spans are never queued, and encoded but never exported")
    p.add_argument("--worker-arg", action="append", default=[])
    p.add_argument("--json", default="")
    args = p.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="bench-tenancy-"))
    results: dict = {"machine": cpu_flags()}
    print(results["machine"], flush=True)
    if "noisy" in args.parts or "weights" in args.parts:
        noisy, shares = part_stack(args, log_dir)
        if noisy:
            results["noisy"] = noisy
            alone = noisy["alone"]["ttft_ms"]
            print(f"\nNoisy neighbour ({args.model}, 1 colocated worker): {args.flood} flood streams of "
                  f"{args.flood_prompt}-token prompts x {args.flood_tokens} tokens; the quiet tenant: "
                  f"{args.quiet_requests} requests of {args.quiet_prompt} -> {args.quiet_tokens} tokens, one at a time")
            alone_itl = noisy["alone"]["itl_ms"]
            print(f"{'quiet requests':<52}{'TTFT p50 ms':>13}{'x alone':>9}{'ITL p50 ms':>12}{'x alone':>9}"
                  f"{'flood ITL p50 ms':>18}")
            for label, r in noisy.items():
                print(f"{label:<52}{r['ttft_ms']:>13.1f}{r['ttft_ms'] / alone:>9.2f}{r['itl_ms']:>12.1f}"
                      f"{r['itl_ms'] / alone_itl:>9.2f}{r.get('flood_itl_ms', float('nan')):>18.1f}")
        if shares:
            results["weights"] = shares
            print(f"\nWeights 2:1, both saturating ({args.weight_streams} streams each, --max-num-seqs "
                  f"{args.max_num_seqs}), {args.weights_seconds:.0f} s: completion tokens heavy {shares['heavy']:.0f}, "
                  f"light {shares['light']:.0f}, ratio {shares['ratio']:.2f}")
    if "router" in args.parts:
        cpu = part_router(args, log_dir)
        results["router_us_per_request"] = {k: us for k, (us, _) in cpu.items()}
        results["router_vs_first"] = {k: ratio for k, (_, ratio) in cpu.items()}
        load = (f"{args.router_rate:.0f} requests/s offered" if args.router_rate else
                f"{args.router_clients} clients, closed loop")
        print(f"\nRouter CPU per request (zero-cost upstream, {load}, --max-concurrency "
              f"{args.router_clients // 2}; medians of {args.router_rounds} rounds; 'vs first': the median of each "
              "round's ratio)")
        print(f"{'router':<48}{'CPU us/request':>16}{'vs first':>10}")
        for label, (us, ratio) in cpu.items():
            print(f"{label:<48}{us:>16.0f}{ratio:>10.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    shutil.rmtree(log_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
