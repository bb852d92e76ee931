"""n choices cost one prefill: TTFT of `n=4` vs `n=1` for a long prompt, side by side in one run.

The router sends a request's n choices as n requests; the workers' schedulers let the copies
wait for the prefix the first one is computing and reuse its blocks, so only the prompt's last
partial block is computed n times. TTFT here = until every choice has its first token.

    python -m loadtest.bench_n                  # SmolLM2, ~1,000-token prompt, colocated and PD
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from loadtest.stack import Stack


async def ttft(url: str, model: str, prompt: str, n: int, max_tokens: int) -> float:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "n": n, "stream": True, "ignore_eos": True}
    started: set[int] = set()
    t0 = time.perf_counter()
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {await r.text()}")
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            for c in json.loads(line[6:])["choices"]:
                if c["delta"].get("content"):
                    started.add(c["index"])
            if len(started) == n:
                return time.perf_counter() - t0
    raise RuntimeError(f"only {len(started)} of {n} choices produced text")


def prompt_of(round_: int, words: int) -> str:
    """A different ~`words`-word prompt per round, so no round hits an earlier round's cache."""
    vocab = ["river", "stone", "cloud", "lantern", "harbor", "meadow", "signal", "copper", "orbit", "quiet"]
    return f"Round {round_}. " + " ".join(vocab[(round_ * 7 + i * 3) % len(vocab)] + str(i % 13) for i in range(words))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--words", type=int, default=430, help="prompt words (~1,000 SmolLM2 tokens)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--modes", default="colocated,pd")
    args = p.parse_args()
    from engine.loading.model_store import resolve_model

    model_dir = resolve_model(args.model)
    name = Path(model_dir).name
    logs = Path(tempfile.mkdtemp(prefix="bench-n-"))
    print(f"model {name}, prompt ~{args.words} words, n={args.n} vs n=1, {args.rounds} interleaved rounds "
          f"(logs: {logs})")
    print(f"{'mode':<11}{'TTFT n=1 (p50)':>16}{f'TTFT n={args.n} (p50)':>16}{'ratio':>8}")
    for mode in args.modes.split(","):
        layout = ["--colocated"] if mode == "colocated" else ["--prefill", "1", "--decode", "1"]
        with Stack(f"bench-n-{mode}", ["--model", str(model_dir), *layout, "--no-redis", "--kv-cache-gb", "0.5"],
                   logs) as stack:
            asyncio.run(ttft(stack.url, name, prompt_of(999, 40), 1, 2))  # warm-up
            one, many = [], []
            for r in range(args.rounds):
                # Each round uses fresh prompts (no cache hits across rounds), alternating the order.
                a = asyncio.run(ttft(stack.url, name, prompt_of(2 * r, args.words), 1, args.max_tokens))
                b = asyncio.run(ttft(stack.url, name, prompt_of(2 * r + 1, args.words), args.n, args.max_tokens))
                one.append(a)
                many.append(b)
            m1, mn = statistics.median(one), statistics.median(many)
            print(f"{mode:<11}{m1 * 1000:>14.0f}ms{mn * 1000:>14.0f}ms{mn / m1:>8.2f}", flush=True)
    print(f"target: TTFT of n={args.n} <= 1.2x n=1")
    return 0


if __name__ == "__main__":
    sys.exit(main())
