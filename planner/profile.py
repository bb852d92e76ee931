"""`splitfire planner profile`: what one worker of the deployed model sustains, measured through the
router: prompt tokens/s and the time each prompt costs beside its tokens (distinct prompts of 16 and of
`--prompt-len` tokens one at a time: the line through their times to first token), and the
inter-token time at each decode batch size (that many concurrent streams), and at the largest batch again with
long prompts: what a step pays per token of context (`Profile.kv_s_per_token`). Run it against a fleet of
one prefill and one decode worker (or one colocated worker): with more, the router spreads the load
and the numbers are the fleet's, not a worker's.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import aiohttp

from planner.decision import Profile


def save(profile: Profile, path: str | Path) -> None:
    Path(path).write_text(json.dumps({"prefill_tps": profile.prefill_tps,
                                      "decode_itl": {str(b): s for b, s in sorted(profile.decode_itl.items())},
                                      "profiled_context": profile.profiled_context,
                                      "kv_s_per_token": profile.kv_s_per_token, "kv_tokens": profile.kv_tokens,
                                      "prefill_overhead_s": profile.prefill_overhead_s},
                                     indent=1))


def load(path: str | Path) -> Profile:
    try:
        d = json.loads(Path(path).read_text())
        return Profile(float(d["prefill_tps"]), {int(b): float(s) for b, s in d["decode_itl"].items()},
                       profiled_context=float(d.get("profiled_context", 0.0)),
                       kv_s_per_token=float(d.get("kv_s_per_token", 0.0)), kv_tokens=int(d.get("kv_tokens", 0)),
                       prefill_overhead_s=float(d.get("prefill_overhead_s", 0.0)))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"--profile {path}: not a planner profile ({e}); make one with `splitfire planner profile`") \
            from e


async def _stream(session: aiohttp.ClientSession, url: str, model: str, ids: list[int], max_tokens: int
                  ) -> tuple[float, list[float]]:
    """(time to first token, gaps between the following tokens) of one streamed completion."""
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    t0 = time.perf_counter()
    first, last, gaps = 0.0, 0.0, []
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url} answered {r.status}: {(await r.text())[:200]}")
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            if not first:
                first = now - t0
            else:
                gaps.append(now - last)
            last = now
    return first, gaps


async def measure(url: str, model: str, batches: list[int], prompt_len: int = 512, decode_tokens: int = 32,
                  rounds: int = 3, vocab: int = 32000) -> Profile:
    rng = random.Random(0)

    def ids(n: int) -> list[int]:  # distinct random prompts: no prefix-cache hits
        return [rng.randrange(3, vocab) for _ in range(n)]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        await _stream(s, url, model, ids(16), 2)  # warm-up
        ttfts = [(await _stream(s, url, model, ids(prompt_len), 1))[0] for _ in range(rounds)]
        short = [(await _stream(s, url, model, ids(16), 1))[0] for _ in range(rounds)]
        itl: dict[int, float] = {}
        for b in batches:
            runs = await asyncio.gather(*(_stream(s, url, model, ids(16), decode_tokens) for _ in range(b)))
            itl[b] = statistics.median(g for _, gaps in runs for g in gaps)
        # the largest batch again with prompts of `prompt_len`: what a step pays per token of context beyond the
        # short prompts' (the KV cache read), for sizing decode by the streams' real context
        b = max(batches)
        runs = await asyncio.gather(*(_stream(s, url, model, ids(prompt_len), decode_tokens) for _ in range(b)))
        long_itl = statistics.median(g for _, gaps in runs for g in gaps)
    kv_s = max(long_itl - itl[b], 0.0) / (b * (prompt_len - 16))
    # time to first token = overhead + tokens / rate, through the two lengths' medians (a short prompt measured no
    # faster than a long one's share: no overhead, the long prompts' rate). The intercept is all a prompt waits
    # for beside its tokens — the router and the hand-off included — so it bounds what it holds a worker for.
    long_s, short_s = statistics.median(ttfts), statistics.median(short)
    per_token = max(long_s - short_s, 0.0) / (prompt_len - 16)
    if per_token <= 0 or short_s - 16 * per_token <= 0:
        return Profile(prompt_len / long_s, itl, profiled_context=16 + decode_tokens / 2, kv_s_per_token=kv_s)
    return Profile(1.0 / per_token, itl, profiled_context=16 + decode_tokens / 2, kv_s_per_token=kv_s,
                   prefill_overhead_s=short_s - 16 * per_token)
