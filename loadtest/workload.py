"""Seeded synthetic workloads and a streaming client that records TTFT and inter-token gaps."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp

WORDS = ("the of and to in is was for on that with as by at from his her an be this are or which but not have "
         "one had they you were all their there been has more when will would who what so can out up about into "
         "than them only other new some could time these two may then first any like now over such our man me "
         "even most made after also did many before must through back years where much your way well down should "
         "because each just those people how too little state good very make world still own see men work long "
         "get here between both life being under never day same another know while last might us great old year "
         "off come since against go came right used take three serving latency decode prefill cache token router "
         "tensor kernel memory bandwidth cluster request stream batch worker transfer affinity session").split()


def text_of(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


@dataclass
class Job:
    at: float  # seconds after the start
    kind: str  # short | long
    messages: list[dict]
    max_tokens: int
    session: str | None = None


@dataclass
class Result:
    job: Job
    start: float = 0.0
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)  # between consecutive content chunks
    gap_times: list[float] = field(default_factory=list)  # when each gap ended (s after bench start)
    chunks: int = 0
    completion_tokens: int = 0
    error: str | None = None
    end: float = 0.0


def mixed_workload(seed: int, duration_s: float, short_rate: float, long_every_s: float,
                   short_words: tuple[int, int] = (30, 60), long_words: tuple[int, int] = (900, 1400),
                   short_max_tokens: int = 64, long_max_tokens: int = 16) -> list[Job]:
    """A steady Poisson stream of short-prompt, long-output chats plus a long prompt every `long_every_s`."""
    rng = random.Random(seed)
    jobs: list[Job] = []
    t = 0.0
    while True:
        t += rng.expovariate(short_rate)
        if t >= duration_s:
            break
        jobs.append(Job(t, "short", [{"role": "user", "content": text_of(rng, rng.randint(*short_words))}],
                        short_max_tokens))
    t = long_every_s / 2
    while t < duration_s:
        jobs.append(Job(t, "long", [{"role": "user", "content": text_of(rng, rng.randint(*long_words))}],
                        long_max_tokens))
        t += long_every_s
    return sorted(jobs, key=lambda j: j.at)


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[dict]:
    """The JSON objects of an OpenAI-style event stream (`data: {...}` lines; `[DONE]` skipped)."""
    async for line in resp.content:
        if line.startswith(b"data: {"):
            yield json.loads(line[6:])


async def run_one(session: aiohttp.ClientSession, url: str, model: str, job: Job, t_bench: float) -> Result:
    r = Result(job)
    body = {"model": model, "messages": job.messages, "max_tokens": job.max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    headers = {"x-session-affinity": job.session} if job.session else {}
    r.start = time.perf_counter()
    last = None
    try:
        async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return r
            async for obj in sse_events(resp):
                if "error" in obj:
                    r.error = obj["error"]["message"]
                    break
                if obj.get("usage"):
                    r.completion_tokens = obj["usage"]["completion_tokens"]
                if not obj["choices"] or not obj["choices"][0]["delta"].get("content"):
                    continue
                now = time.perf_counter()
                if last is None:
                    r.ttft = now - r.start
                else:
                    r.gaps.append(now - last)
                    r.gap_times.append(now - t_bench)
                last = now
                r.chunks += 1
    except (aiohttp.ClientError, TimeoutError) as e:
        r.error = f"{type(e).__name__}: {e}"
    r.end = time.perf_counter()
    return r


async def replay(url: str, model: str, jobs: list[Job], concurrency_limit: int = 512) -> list[Result]:
    """Send every job at its scheduled time (open loop), stream all of them, return the results."""
    conn = aiohttp.TCPConnector(limit=concurrency_limit)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
        t0 = time.perf_counter()

        async def fire(job: Job) -> Result:
            delay = job.at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            return await run_one(session, url, model, job, t0)

        return await asyncio.gather(*(fire(j) for j in jobs))


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q / 100 * (len(v) - 1))))]


def summarize(results: list[Result]) -> dict[str, float]:
    ok = [r for r in results if r.error is None and r.ttft is not None]
    ttft = [r.ttft for r in ok]
    ttft_short = [r.ttft for r in ok if r.job.kind == "short"]
    gaps = [g for r in ok for g in r.gaps]
    return {
        "requests": len(results), "errors": len(results) - len(ok),
        "ttft_p50": pct(ttft, 50), "ttft_p90": pct(ttft, 90), "ttft_p99": pct(ttft, 99),
        "ttft_short_p90": pct(ttft_short, 90),
        "itl_p50": pct(gaps, 50), "itl_p90": pct(gaps, 90), "itl_p99": pct(gaps, 99),
        "itl_mean": statistics.fmean(gaps) if gaps else float("nan"),
    }


def goodput(results: list[Result], duration_s: float, ttft_slo: float, itl_slo: float) -> float:
    """Requests per second that met both SLOs (DistServe): TTFT <= slo and p90 of own gaps <= slo."""
    good = 0
    for r in results:
        if r.error is None and r.ttft is not None and r.ttft <= ttft_slo and (not r.gaps or pct(r.gaps, 90) <= itl_slo):
            good += 1
    return good / duration_s
