"""Driving an `LLMEngine` in process for the benchmarks: prompts, prefill, decode rates. Shared by
`bench_engine.py`, `bench_mla.py` and `bench_quant.py` (which `bench_engine` dispatches to)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from common.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine


def prompt_ids(tokenizer, n: int, salt: int = 0) -> list[int]:
    base = tokenizer.encode(" ".join(f"word{(i * 7 + salt) % 997}" for i in range(n)))
    return (base * (n // len(base) + 1))[:n]


def random_ids(vocab: int, n: int, salt: int) -> list[int]:
    """Distinct prompts without a tokenizer (no two share a prefix block, so no prefix-cache hits)."""
    rng = random.Random(salt)
    return [rng.randrange(3, vocab) for _ in range(n)]


def ours_prefill(engine: LLMEngine, ids: list[int], salt: int, adapter: str = "") -> float:
    engine.add_request(f"p{len(ids)}-{salt}", ids, SamplingParams(max_tokens=1, temperature=0), adapter=adapter)
    t0 = time.perf_counter()
    while engine.has_work:
        engine.step()
    return len(ids) / (time.perf_counter() - t0)


def prefill_all(engine: LLMEngine, step: Callable[[], object] | None = None) -> None:
    """Step until every added prompt is computed, with the engine's cap on prompt tokens per decoding
    step lifted: the cap protects running streams' latency, which a decode measurement excludes, and
    under it the first sequences would finish before the last prompts were in (a smaller batch)."""
    cfg = engine.scheduler.config
    cap, cfg.max_prefill_tokens_while_decoding = cfg.max_prefill_tokens_while_decoding, None
    try:
        while engine.scheduler.waiting or any(s.num_remaining > 1 for s in engine.scheduler.running):
            (step or engine.step)()
    finally:
        cfg.max_prefill_tokens_while_decoding = cap


def decode_rate(engine: LLMEngine, prompts: list[list[int]], sp: SamplingParams, tag: str,
                adapters: list[str] | None = None) -> float:
    """Output tokens per second of the batch once every prompt is decoding (its prefill excluded).
    `adapters`: LoRA adapters the prompts run under, in turn."""
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", ids, SamplingParams(**{**sp.__dict__}),
                           adapter=adapters[i % len(adapters)] if adapters else "")
    prefill_all(engine)
    engine.step()
    t0, tokens = time.perf_counter(), 0
    while engine.has_work:
        tokens += sum(len(o.token_ids) for o in engine.step())
    return tokens / (time.perf_counter() - t0)
