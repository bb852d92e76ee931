"""Latent attention's decode paths side by side: absorbed (the default) vs up-projecting (the reference).

One random DeepSeek-V3-shaped model (loadtest/random_models.py: 8 layers x 1024 hidden, 16 heads,
latent rank 256 + 32 RoPE dims), decode at batch 1 and 16 with every sequence's context at
`--mla-context` tokens. The two paths are switched on the same engine between rounds, so
drift on a shared machine lands on both alike; the tokens they produce are compared too. A second
table times a step of 5-token chunks after a long cached prefix, absorbed vs up-projected.

    python -m loadtest.bench_engine --mla                 # 1024-token contexts, ~5 minutes
    python -m loadtest.bench_engine --mla --mla-context 256
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from tqdm import tqdm

from common.sampling_params import SamplingParams
from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.mla import MLAttention
from loadtest.engine_runs import prefill_all, random_ids

BATCHES = (1, 16)


def set_absorb(engine: LLMEngine, on: bool) -> None:
    for m in engine.model.modules():
        if isinstance(m, MLAttention):
            m.absorb = on


def decode_round(engine: LLMEngine, batch: int, context: int, tokens: int, salt: int) -> tuple[float, list[list[int]]]:
    """(decode tok/s over `tokens` steps once every prompt is in, the tokens each sequence produced)."""
    vocab = engine.model_config.vocab_size
    ids = [f"mla{salt}-{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, random_ids(vocab, context, 7919 * salt + i),
                           SamplingParams(max_tokens=tokens + 1, temperature=0, ignore_eos=True))
    out: dict[str, list[int]] = {rid: [] for rid in ids}

    def step() -> None:
        for o in engine.step():
            out[o.request_id].extend(o.token_ids)

    prefill_all(engine, step)
    t0, steps = time.perf_counter(), 0
    while engine.has_work:
        step()
        steps += 1
    return batch * steps / (time.perf_counter() - t0), [out[r] for r in ids]


def chunk_round(engine: LLMEngine, batch: int, context: int, salt: int, absorb_chunks: bool) -> float:
    """Seconds of the step that computes a 5-token chunk for each of `batch` sequences whose first
    `context` tokens are cached (a prefix hit; a speculative verification has the same shape)."""
    vocab = engine.model_config.vocab_size
    prompts = [random_ids(vocab, context, 4099 * salt + i) for i in range(batch)]
    for i, p in enumerate(prompts):
        engine.add_request(f"pre{salt}-{i}", p, SamplingParams(max_tokens=1, temperature=0))
    while engine.has_work:
        engine.step()
    for m in engine.model.modules():
        if isinstance(m, MLAttention):
            m.absorb_chunks = absorb_chunks
    for i, p in enumerate(prompts):
        engine.add_request(f"chunk{salt}-{i}", p + [5, 6, 7, 8, 9], SamplingParams(max_tokens=1, temperature=0))
    t0 = time.perf_counter()
    engine.step()
    elapsed = time.perf_counter() - t0
    while engine.has_work:
        engine.step()
    return elapsed


def main_mla(args: argparse.Namespace) -> int:
    from loadtest.random_models import model_dir

    ctx, tokens = args.mla_context, args.mla_tokens
    engine = LLMEngine(EngineConfig(model=str(model_dir("deepseek_v3")), device="cpu", dtype=args.dtypes.split(",")[0],
                                    threads=args.threads, max_num_batched_tokens=2048, max_num_seqs=max(BATCHES),
                                    kv_cache_gb=1.0, max_model_len=ctx + tokens + 8, enable_prefix_cache=False))
    decode_round(engine, 2, 64, 2, 0)  # warm-up
    rates: dict[tuple[str, int], list[float]] = {}
    same = True
    for r in tqdm(range(args.rounds), desc="rounds", file=sys.stderr):
        for b in BATCHES:
            outs = {}
            for path, on in (("absorbed", True), ("up-projecting", False)):
                set_absorb(engine, on)
                rate, outs[path] = decode_round(engine, b, ctx, tokens, 100 * r + b)
                rates.setdefault((path, b), []).append(rate)
            same &= outs["absorbed"] == outs["up-projecting"]
    set_absorb(engine, True)
    # Short chunks over a long cached context: a prefix cache is needed for the hit.
    chunked = LLMEngine(EngineConfig(model=str(model_dir("deepseek_v3")), device="cpu", dtype=args.dtypes.split(",")[0],
                                     threads=args.threads, max_num_batched_tokens=2048, max_num_seqs=max(BATCHES),
                                     kv_cache_gb=1.0, max_model_len=ctx + 16))
    chunk_ms: dict[tuple[bool, int], list[float]] = {}
    for r in tqdm(range(args.rounds), desc="chunk rounds", file=sys.stderr):
        for b in (1, 4):
            for on in (True, False):
                chunk_ms.setdefault((on, b), []).append(chunk_round(chunked, b, ctx, 1000 + 10 * r + b + on, on) * 1e3)
    lay = engine.kv.layout
    print(f"\nCPU: {torch.get_num_threads()} threads, torch {torch.__version__}, {args.dtypes.split(',')[0]}; random "
          f"DeepSeek-V3-shaped model ({engine.model_config.num_layers} layers, latent {lay.head_dim} per token "
          f"and layer), {ctx}-token contexts, {tokens} decode steps, median of {args.rounds}")
    print(f"{'batch':<8}{'absorbed tok/s':>18}{'up-projecting tok/s':>22}{'absorbed / up-projecting':>28}")
    for b in BATCHES:
        a, u = statistics.median(rates[("absorbed", b)]), statistics.median(rates[("up-projecting", b)])
        target = "   (target >= 1.5)" if b == 16 else ""
        print(f"{b:<8}{a:>18.1f}{u:>22.1f}{a / u:>28.2f}{target}")
    print(f"greedy tokens identical on both paths: {same}")
    print(f"\n5-token chunks after a {ctx}-token cached prefix (the shape of a speculative verification), step ms:")
    print(f"{'sequences':<10}{'absorbed':>12}{'up-projecting':>16}{'speedup':>10}")
    for b in (1, 4):
        a, u = statistics.median(chunk_ms[(True, b)]), statistics.median(chunk_ms[(False, b)])
        print(f"{b:<10}{a:>12.1f}{u:>16.1f}{u / a:>10.2f}")
    return 0 if same else 1
