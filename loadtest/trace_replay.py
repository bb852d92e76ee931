"""Replay a Mooncake production trace (`../shared/data/mooncake_traces/`) against a running router, scaled
to this machine.

Each trace line is one request: `timestamp` (ms), `input_length`, `output_length` and `hash_ids`, the
ids of its prompt's 512-token prefix blocks (equal ids: the same block, so the KV can be shared). A
trace block becomes `--block` tokens whose ids are a fixed function of the block's hash id (equal ids
give equal token runs, different ids different ones), so prefix sharing is exactly the trace's; input
and output lengths are scaled by the same factor (`--block / 512`); arrivals are compressed by
`--speed`. Prompts go as token ids to `/v1/completions`, streamed, `ignore_eos`.

Reported: cached prompt tokens (from each response's `usage`) against the trace's ideal — the whole
leading blocks of each prompt seen in an earlier request, at most all but the block holding the last
prompt token (an engine computes at least one token), i.e. what an infinite cache shared by every
worker would serve — TTFT and inter-token percentiles, SLO attainment, errors; `--json` writes it all,
`--plot` draws TTFT and the cached share over time.

    python -m loadtest.trace_replay --url http://127.0.0.1:8000 --model M \\
        --trace ../shared/data/mooncake_traces/conversation_trace.jsonl --limit 200 --block 16 --speed 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from loadtest.workload import pct, sse_events

TRACE_BLOCK = 512  # tokens per trace block (the traces' hash granularity)
# Block ids given to a trace without `hash_ids` (../shared/data/varying_load_traces/): far above any id a
# recorded trace uses, so no two requests share a block and nothing is a cache hit.
UNIQUE_BLOCKS = 1 << 48


@dataclass(frozen=True)
class TraceRequest:
    at_s: float  # arrival, seconds from the trace's start
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: str | Path, limit: int | None = None, start_s: float = 0.0,
               window_s: float | None = None) -> list[TraceRequest]:
    """The trace's requests from `start_s` on (for `window_s` seconds, at most `limit` of them), with
    arrivals made relative to `start_s`. A trace without `hash_ids` (one that records no prefix identity) gets
    a unique block id for every 512 tokens of every prompt."""
    out: list[TraceRequest] = []
    unique = UNIQUE_BLOCKS
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                inp = int(d["input_length"])
                if "hash_ids" in d:
                    hashes = tuple(int(h) for h in d["hash_ids"])
                else:  # a trace that records no prefix identity: every block of every prompt its own
                    count = -(-inp // TRACE_BLOCK)
                    hashes, unique = tuple(range(unique, unique + count)), unique + count
                req = TraceRequest(d["timestamp"] / 1000.0, inp, int(d["output_length"]), hashes)
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a trace line ({e})") from e
            if req.at_s < start_s:
                continue
            if window_s is not None and req.at_s >= start_s + window_s:
                break
            out.append(TraceRequest(req.at_s - start_s, req.input_length, req.output_length, req.hash_ids))
            if limit is not None and len(out) >= limit:
                break
    return out


@dataclass(frozen=True)
class Scale:
    block: int  # tokens per trace block here
    vocab: int  # token ids are drawn from [first_id, vocab)
    first_id: int = 3  # (below: special tokens on most vocabularies)
    max_output: int = 1 << 30

    @property
    def factor(self) -> float:
        return self.block / TRACE_BLOCK

    def block_tokens(self, hash_id: int) -> list[int]:
        """The token run standing for trace block `hash_id`: the same run for the same id, always."""
        rng = random.Random(hash_id * 1_000_003 + 7)
        return [rng.randrange(self.first_id, self.vocab) for _ in range(self.block)]

    def input_tokens(self, req: TraceRequest) -> int:
        return max(1, min(math.ceil(req.input_length * self.factor), len(req.hash_ids) * self.block))

    def output_tokens(self, req: TraceRequest) -> int:
        return max(1, min(self.max_output, round(req.output_length * self.factor)))

    def prompt(self, req: TraceRequest) -> list[int]:
        ids: list[int] = []
        for h in req.hash_ids:
            ids += self.block_tokens(h)
        return ids[: self.input_tokens(req)]


def ideal_cached(reqs: list[TraceRequest], scale: Scale) -> list[int]:
    """Per request, the prompt tokens an infinite cache shared by every worker could serve: its leading
    blocks seen in any earlier request, at most all but the block holding the last prompt token."""
    return leading_cached(reqs, [scale.input_tokens(r) for r in reqs], scale.block)


def leading_cached(reqs: list[TraceRequest], prompt_tokens: list[int], block: int) -> list[int]:
    """`ideal_cached` for prompts of `prompt_tokens` tokens, `block` tokens a trace block."""
    seen: set[int] = set()
    out: list[int] = []
    for req, n in zip(reqs, prompt_tokens, strict=True):
        leading = 0
        for h in req.hash_ids:
            if h not in seen:
                break
            leading += 1
        out.append(min(leading, (n - 1) // block) * block)
        seen.update(req.hash_ids)
    return out


@dataclass
class Outcome:
    index: int
    sent_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ideal_cached: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    error: str | None = None


async def _one(session: aiohttp.ClientSession, url: str, model: str, ids: list[int], max_tokens: int,
               out: Outcome, t0: float) -> None:
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    out.sent_s = start - t0
    last = None
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                out.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return
            async for obj in sse_events(r):
                if "error" in obj:
                    out.error = str(obj["error"])[:200]
                    return
                if obj.get("choices") and obj["choices"][0].get("text"):
                    now = time.perf_counter()
                    if last is None:
                        out.ttft_s = now - start
                    else:
                        out.gaps_s.append(now - last)
                    last = now
                usage = obj.get("usage")
                if usage:
                    out.prompt_tokens = usage["prompt_tokens"]
                    out.completion_tokens = usage["completion_tokens"]
                    out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        out.error = f"{type(e).__name__}: {e}"


async def replay(url: str, model: str, reqs: list[TraceRequest], scale: Scale, speed: float,
                 max_inflight: int = 256, timeout_s: float = 600.0) -> list[Outcome]:
    """Each request sent at its arrival / `speed` (later when `max_inflight` are already running)."""
    ideal = ideal_cached(reqs, scale)
    outs = [Outcome(i, ideal_cached=ideal[i]) for i in range(len(reqs))]
    slots = asyncio.Semaphore(max_inflight)
    # Idle connections are dropped after 5 s (httpx's default, the OpenAI SDK's): aiohttp's default of 15 s
    # equals the router's keep-alive timeout, so a reused connection could be the one the router is closing
    # right then (the request then fails with "Server disconnected" without reaching it).
    conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=5.0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        t0 = time.perf_counter()

        async def run(i: int, req: TraceRequest) -> None:
            delay = req.at_s / speed - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            async with slots:
                await _one(session, url, model, scale.prompt(req), scale.output_tokens(req), outs[i], t0)

        await asyncio.gather(*(run(i, r) for i, r in enumerate(reqs)))
    return outs


def summarize(outs: list[Outcome], ttft_slo_s: float, itl_slo_s: float) -> dict[str, float]:
    ok = [o for o in outs if o.error is None]
    gaps = [g for o in ok for g in o.gaps_s]
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    cached, ideal = sum(o.cached_tokens for o in ok), sum(o.ideal_cached for o in ok)
    met = [o for o in ok if o.ttft_s is not None and o.ttft_s <= ttft_slo_s
           and (not o.gaps_s or pct(o.gaps_s, 90) <= itl_slo_s)]
    return {
        "requests": len(outs), "errors": len(outs) - len(ok),
        "prompt_tokens": sum(o.prompt_tokens for o in ok), "cached_tokens": cached, "ideal_cached_tokens": ideal,
        "cached_vs_ideal": cached / ideal if ideal else float("nan"),
        "ttft_p50_ms": pct(ttfts, 50) * 1e3, "ttft_p90_ms": pct(ttfts, 90) * 1e3, "ttft_p99_ms": pct(ttfts, 99) * 1e3,
        "itl_p50_ms": pct(gaps, 50) * 1e3, "itl_p90_ms": pct(gaps, 90) * 1e3, "itl_p99_ms": pct(gaps, 99) * 1e3,
        "slo_attainment": len(met) / len(outs) if outs else float("nan"),
    }


def plot(outs: list[Outcome], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = sorted((o for o in outs if o.error is None and o.ttft_s is not None), key=lambda o: o.sent_s)
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    a.plot([o.sent_s for o in ok], [o.ttft_s * 1e3 for o in ok], ".", ms=3)  # type: ignore[operator]
    a.set_ylabel("TTFT ms")
    a.set_yscale("log")
    cum_c = cum_i = 0
    xs, ys = [], []
    for o in ok:
        cum_c, cum_i = cum_c + o.cached_tokens, cum_i + o.ideal_cached
        xs.append(o.sent_s)
        ys.append(cum_c / cum_i if cum_i else float("nan"))
    b.plot(xs, ys)
    b.set_ylabel("cached / ideal (cumulative)")
    b.set_xlabel("seconds into the replay")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="the router, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--trace", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "mooncake_traces"
                                          / "conversation_trace.jsonl"))
    p.add_argument("--limit", type=int, default=200, help="requests replayed at most")
    p.add_argument("--start", type=float, default=0.0, help="seconds into the trace to start at")
    p.add_argument("--window", type=float, default=None, help="seconds of the trace to replay")
    p.add_argument("--block", type=int, default=16, help="tokens standing for one 512-token trace block")
    p.add_argument("--speed", type=float, default=10.0, help="arrivals compressed by this factor")
    p.add_argument("--vocab", type=int, default=49152, help="token ids drawn below this (the model's vocabulary)")
    p.add_argument("--max-output", type=int, default=64, help="scaled output tokens capped at this")
    p.add_argument("--max-inflight", type=int, default=256, help="requests in flight at most (later ones wait)")
    p.add_argument("--ttft-slo", type=float, default=2.0, help="seconds")
    p.add_argument("--itl-slo", type=float, default=0.2, help="seconds (each request's p90 gap)")
    p.add_argument("--json", default="", help="write the summary and every request's outcome here")
    p.add_argument("--plot", default="", help="write a PNG of TTFT and the cached share over time here")
    args = p.parse_args()
    reqs = read_trace(args.trace, args.limit, args.start, args.window)
    scale = Scale(args.block, args.vocab, max_output=args.max_output)
    print(f"{len(reqs)} requests over {reqs[-1].at_s if reqs else 0:.0f} s of trace, replayed x{args.speed}; "
          f"{args.block} tokens a block: prompts {statistics.mean(scale.input_tokens(r) for r in reqs):.0f} tokens "
          f"on average", file=sys.stderr)
    outs = asyncio.run(replay(args.url.rstrip("/"), args.model, reqs, scale, args.speed, args.max_inflight))
    summary = summarize(outs, args.ttft_slo, args.itl_slo)
    for k, v in summary.items():
        print(f"{k:<22}{v:>12.3f}" if isinstance(v, float) else f"{k:<22}{v:>12}")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "args": vars(args),
                                               "requests": [asdict(o) for o in outs]}, indent=1))
    if args.plot:
        plot(outs, args.plot)
    return 0 if summary["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
