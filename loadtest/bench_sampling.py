"""The sampler's host time per decode step: the batched sampler the engine runs against the plain
row-by-row reference, on real next-token distributions.

`python -m loadtest.bench_engine --sampling` (SmolLM2 by default): the model's logits at every
position of the shipped prose (`data/prose.txt`, 512-token windows, computed by the engine's own
model), taken `batch` rows at a time, sampled under common settings by `sampler.sample` (what a
decode step calls: `sample_batch`, cuts from the most likely tokens) and by
`draw(filtered_probs(row))` per row (the reference it is held equal to). Medians over the row
groups; beside them the share of rows that keep fewer tokens than the first candidates (drawn from
those alone; the others are drawn from their whole row).
Greedy is the floor: one argmax over the batch.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common.sampling_params import SamplingParams
from engine.batch.sampler import CANDIDATES, draw, filtered_probs, sample
from engine.batch.sequence import Sequence
from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine
from loadtest.quality import PROSE, window_hidden

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "T=1.0": dict(temperature=1.0),
    "T=0.7, top_p=0.9": dict(temperature=0.7, top_p=0.9),
    "T=1.0, top_p=0.95": dict(temperature=1.0, top_p=0.95),
    "T=0.7, top_k=50, top_p=0.9": dict(temperature=0.7, top_k=50, top_p=0.9),
    "T=0.8, min_p=0.05": dict(temperature=0.8, min_p=0.05),
}


@torch.inference_mode()
def prose_logits(engine: LLMEngine, window: int = 512) -> torch.Tensor:
    """[positions, vocab]: the model's next-token logits at every position of the prose."""
    ids = engine.tokenizer.encode(PROSE.read_text())
    return torch.cat([engine.model.logits(window_hidden(engine, ids[start : start + window])).float()
                      for start in range(0, len(ids) - 1, window)])


def _ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main_sampling(args: argparse.Namespace) -> int:
    engine = LLMEngine(EngineConfig(model=args.model, device="cpu", threads=args.threads, kv_cache_gb=0.5))
    logits = prose_logits(engine)
    vocab = logits.shape[-1]
    print(f"\nCPU: {torch.get_num_threads()} threads, torch {torch.__version__}, model {engine.model_dir}; "
          f"{logits.shape[0]} positions of real logits over a {vocab}-token vocabulary; ms per step (median "
          f"over groups of `batch` positions); first candidates {CANDIDATES[0]}")
    print(f"{'settings':<28}{'batch':>6}{'batched ms':>12}{'row by row ms':>15}{'speedup':>9}{'few kept':>10}")
    for name, kw in SETTINGS.items():
        sp = SamplingParams(**kw)
        for b in [int(x) for x in args.sampling_batches.split(",")]:
            groups = [logits[i : i + b] for i in range(0, logits.shape[0] - b + 1, b)][: args.sampling_groups]
            seqs = [Sequence(f"s{i}", [1], sp) for i in range(b)]
            fast = statistics.median(_ms(lambda g=g, q=seqs: sample(g, q), 3) for g in groups)
            if sp.greedy:
                print(f"{name:<28}{b:>6}{fast:>12.3f}{'-':>15}{'-':>9}{'-':>8}")
                continue
            ref = statistics.median(_ms(lambda g=g, p=sp: [draw(filtered_probs(r, p), None) for r in g], 1)
                                    for g in groups[: max(1, args.sampling_groups // 4)])
            # rows whose kept tokens all lie among the first candidates (drawn from those alone)
            kept = sum(int((filtered_probs(r, sp) > 0).sum()) < CANDIDATES[0] for g in groups for r in g)
            print(f"{name:<28}{b:>6}{fast:>12.3f}{ref:>15.3f}{ref / fast:>8.1f}x"
                  f"{kept / sum(len(g) for g in groups):>10.0%}", flush=True)
    return 0
