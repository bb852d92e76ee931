"""Session affinity and prefix-aware placement: a multi-turn agent workload (a shared system
prompt, 10 turns per session, a context that grows every turn) against 4 workers, once with
the token policy + `x-session-affinity`, once with the random policy. Prints the workers'
prefix-cache hit ratio (tokens served from cache / prompt tokens) for both, side by side.

Each turn appends a tool output (new to every cache) and the agent's reply (already in the
cache of the worker that generated it, if the next turn goes back there). The default model is
SmolLM2: its replies re-tokenize to the tokens it generated, which a random model's do not
(`--model tiny` is faster, but then no reply can ever be a cache hit). Each worker's KV cache
is sized for about its own share of the sessions, as a production deployment is provisioned.

    python -m loadtest.bench_affinity              # SmolLM2, ~25 minutes on 2 cores (3 rows)
    python -m loadtest.bench_affinity --kv-cache-gb 0.15,1 --placements affinity,random   # a sweep
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from engine.engine_config import EngineConfig
from loadtest.bench_router import spawn
from loadtest.stack import ROOT, free_port
from loadtest.workload import text_of

SYSTEM_UNIT = ("You are a coding agent with tools read_file(path), run_tests(), search(query). Call one tool per "
               "turn and report results concisely. ")


# name: (router policy, send x-session-affinity, row label)
PLACEMENTS = {"affinity": ("token", True, "token + x-session-affinity"),
              "token": ("token", False, "token, no affinity header"),
              "random": ("random", False, "random, no affinity header"),
              "random_store": ("random", False, "random + shared KV store")}
STORE_GB = 0.25  # what each worker lends to the shared KV store in the *_store rows


async def run_sessions(url: str, sessions: int, turns: int, use_affinity: bool, seed: int, system: str,
                       max_tokens: int, history: list[list[dict]] | None = None) -> tuple[int, int, list[list[dict]]]:
    """Runs every session (continuing `history` if given); returns (failed requests, tokens of all
    sessions' final contexts, the sessions' messages)."""
    rng = random.Random(seed)
    errors = 0
    final_context = 0
    histories = history or [[{"role": "system", "content": system}] for _ in range(sessions)]

    async def session(i: int) -> None:
        nonlocal errors, final_context
        messages = histories[i]
        async with aiohttp.ClientSession() as s:
            for t in range(turns):
                messages.append({"role": "user", "content": f"tool output {t}: " + text_of(rng, rng.randint(20, 50))})
                headers = {"x-session-affinity": f"agent-{seed}-{i}"} if use_affinity else {}
                body = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
                async with s.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
                    if r.status != 200:
                        errors += 1
                        return
                    answer = await r.json()
                reply = answer["choices"][0]["message"]["content"]
                messages.append({"role": "assistant", "content": reply})
            final_context += answer["usage"]["total_tokens"]

    await asyncio.gather(*(session(i) for i in range(sessions)))
    return errors, final_context, histories


async def worker_stats(workers: list[str]) -> tuple[int, int, int]:
    """Summed over the workers: prefix-hit tokens, prefix-query tokens, and one worker's KV capacity in
    tokens."""
    import grpc

    from protos import splitfire_pb2 as pb
    from protos import splitfire_pb2_grpc as pbg

    hit = query = capacity = 0
    for w in workers:
        async with grpc.aio.insecure_channel(w) as ch:
            st = await pbg.WorkerStub(ch).Stats(pb.StatsRequest())
        hit += st.prefix_hit_tokens + st.store_hit_tokens
        query += st.prefix_query_tokens
        capacity = st.kv_blocks_total * EngineConfig.block_size  # workers run the default
    return hit, query, capacity


def affinity_bound(workers: int, turns: int) -> float:
    """The most affinity can beat random placement by when no cache ever evicts, even with no
    shared prompt and no uncacheable tool output: at turn k random finds the session's history
    up to the last earlier turn that landed on the same worker (lag L with probability
    (1 - 1/W)^(L-1) / W), affinity all k - 1 turns of it."""
    q = 1 - 1 / workers
    found = sum((k - lag) * q ** (lag - 1) / workers for k in range(1, turns + 1) for lag in range(1, k))
    return sum(range(turns)) / found


@dataclass
class Cell:
    ratio: float  # prefix-hit tokens (every tier) / prompt tokens, all workers
    errors: int
    capacity: int  # KV tokens one worker holds
    share: float  # the sessions' final contexts / workers: what one worker holds with perfect affinity
    fresh: float | None = None  # with a shared store: a new worker's hit ratio on one more turn of every session


def run(name: str, model: str, kv_gb: float, args: argparse.Namespace, out: Path) -> Cell:
    policy, affinity, _ = PLACEMENTS[name]
    procs = []
    store: list[str] = []
    try:
        if name.endswith("_store"):
            from kvtransfer.store import master_command

            mport = free_port()
            procs.append(spawn(master_command(mport, free_port()), "", out / "aff-kv-master.log", port=mport))
            store = ["--kv-store", f"127.0.0.1:{mport}", "--kv-store-gb", str(STORE_GB)]

        def worker(i: int) -> str:
            port = free_port()
            procs.append(spawn(["-m", "splitfire_cli", "serve", "--model", model, "--host", "127.0.0.1",
                                "--grpc-port", str(port), "--metrics-port", str(free_port()), "--kv-cache-gb",
                                str(kv_gb), "--threads", "1", *store], "worker ready", out / f"aff-w{i}.log"))
            return f"127.0.0.1:{port}"

        def router(addrs: list[str], tag: str) -> str:
            rport = free_port()
            procs.append(spawn(["-m", "splitfire_cli", "router", "--host", "127.0.0.1", "--port", str(rport), "--model",
                                model, "--served-model-name", "bench", "--policy", policy, "--colocated", *addrs,
                                *(["--shared-kv-store"] if store else [])], "router ready",
                               out / f"aff-router-{policy}{tag}.log"))
            return f"http://127.0.0.1:{rport}"

        addrs = [worker(i) for i in range(args.workers)]
        errors, final_context, histories = asyncio.run(run_sessions(
            router(addrs, ""), args.sessions, args.turns, affinity, args.seed, SYSTEM_UNIT * args.system_repeats,
            args.max_tokens))
        hit, query, capacity = asyncio.run(worker_stats(addrs))
        cell = Cell(hit / query, errors, capacity, final_context / args.workers)
        if store:  # scale-out: a worker started now serves one more turn of every (warm) session
            fresh = worker(args.workers)
            more, _, _ = asyncio.run(run_sessions(router([fresh], "-fresh"), args.sessions, 1, False, args.seed + 1,
                                                  "", args.max_tokens, histories))
            hit, query, _ = asyncio.run(worker_stats([fresh]))
            cell.fresh, cell.errors = hit / query, cell.errors + more
        return cell
    finally:
        for p in reversed(procs):  # workers before the master they unmount from
            p.terminate()
            p.wait(20)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="smollm2 (default), tiny (a random Llama made here), or a "
                   "model directory")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--sessions", type=int, default=12)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--system-repeats", type=int, default=8, help="system prompt = 8 x a 25-word tool preamble "
                   "(200 words, a small agent's tool definitions)")
    p.add_argument("--max-tokens", type=int, default=64, help="the agent's reply per turn (a tool call)")
    p.add_argument("--kv-cache-gb", default="0.2", help="per worker, or a comma-separated sweep; 0.2 GB holds 4,656 "
                   "SmolLM2 tokens (fp32), 1.1x a worker's share of the sessions' final contexts (printed)")
    p.add_argument("--placements", default=",".join(PLACEMENTS), help="which of " + ", ".join(PLACEMENTS))
    p.add_argument("--out", default="loadtest/results")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model == "tiny":
        sys.path.insert(0, str(ROOT / "tests"))
        from tiny_model import make_tiny_llama

        model = str(make_tiny_llama(Path(tempfile.mkdtemp()) / "tiny", max_positions=16384))
    else:
        from engine.loading.model_store import resolve_model

        model = str(resolve_model(model))
    placements = args.placements.split(",")
    if unknown := set(placements) - set(PLACEMENTS):
        p.error(f"unknown placements {sorted(unknown)}; choose from {', '.join(PLACEMENTS)}")
    sizes = [float(x) for x in args.kv_cache_gb.split(",")]
    print(f"{args.sessions} agent sessions x {args.turns} turns, shared system prompt ({args.system_repeats} x 25 "
          f"words), 20-50 words of tool output and a reply of up to {args.max_tokens} tokens per turn, "
          f"{args.workers} workers, model {Path(model).name}")
    print(f"{'KV GB/worker':<14}{'placement':<30}{'prefix-hit ratio':>18}{'errors':>8}{'KV tokens/worker':>18}"
          f"{'share':>8}", flush=True)
    for kv_gb in sizes:
        ratios = {}
        for name in placements:
            label = PLACEMENTS[name][2]
            cell = run(name, model, kv_gb, args, out)
            ratios[name] = cell.ratio
            print(f"{kv_gb:<14}{label:<30}{cell.ratio:>18.1%}{cell.errors:>8}{cell.capacity:>18}{cell.share:>8.0f}",
                  flush=True)
            if cell.fresh is not None:
                print(f"{kv_gb:<14}{'  a worker started after them':<30}{cell.fresh:>18.1%}   (one more turn of "
                      f"every session; target >= 80%)", flush=True)
        if "random_store" in ratios:
            print(f"{kv_gb:<14}random + store: {ratios['random_store']:.1%} (target >= 85%)", flush=True)
        if "affinity" in ratios and "random" in ratios:
            print(f"{kv_gb:<14}affinity / random = {ratios['affinity'] / ratios['random']:.2f}   "
                  "(targets: affinity >= 90%, >= 2x random)", flush=True)
    print("share: the sessions' final contexts (tokens) / workers — what each worker holds with perfect affinity "
          "(the shared system prompt counted once per session)")
    print(f"without eviction affinity / random cannot exceed {affinity_bound(args.workers, args.turns):.2f} for "
          f"{args.turns} turns on {args.workers} workers; beyond that it comes from memory pressure")
    return 0


if __name__ == "__main__":
    sys.exit(main())
