"""Measure a worker's cost model on this CPU, in process, for `loadtest/fleet_sim.py --cost-model-json`.

What `fleet_sim.CostModel` needs, measured with the engine a served worker runs (`LLMEngine`, the
model `splitfire up` serves, `--threads` compute threads: `splitfire up --prefill 1 --decode 1` on
two cores pins one core per worker): the time to prefill a whole prompt (cold prefix cache, in the
worker's 512-token chunks) at several lengths — long prompts cost more per token, each chunk
attending to the ones before — and the decode step's time at each batch with `--context` tokens of
context per stream. Medians of `--rounds`.

    python -m loadtest.cpu_cost_model --threads 1 --context 448 --out loadtest/results/cpu_cost_model.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path


def measure(model: str, threads: int, prompt_len: int, context: int, batches: list[int], rounds: int,
            steps: int, prefill_lengths: list[int]) -> dict[str, object]:
    from common.sampling_params import SamplingParams
    from engine.engine_config import EngineConfig
    from engine.llm_engine import LLMEngine

    # The served worker's defaults (a prompt goes in chunks of 512 tokens), so long prompts pay what they pay
    # there: each chunk's attention over the chunks before it.
    eng = LLMEngine(EngineConfig(model=model, threads=threads, max_num_seqs=max(batches), max_num_batched_tokens=512,
                                 kv_cache_gb=1.0, speculative="off", max_prefill_tokens_while_decoding=0))
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, 49000) for _ in range(n)]

    def prefill_s(n: int) -> float:
        times = []
        for r in range(rounds + 1):  # a warm-up first
            eng.add_request(f"p{n}-{r}", prompt(n), SamplingParams(max_tokens=1, temperature=0))
            t0 = time.perf_counter()
            while eng.seqs:
                eng.step()
            if r:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    curve = {n: prefill_s(n) for n in sorted({*prefill_lengths, prompt_len})}
    decode: dict[int, float] = {}
    for b in batches:
        per_round = []
        for r in range(rounds):
            for i in range(b):
                eng.add_request(f"d{b}-{r}-{i}", prompt(context), SamplingParams(max_tokens=steps + 10, temperature=0,
                                                                                ignore_eos=True))
            while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.seqs.values()):
                eng.step()
            eng.step()
            t0 = time.perf_counter()
            for _ in range(steps):
                eng.step()
            per_round.append((time.perf_counter() - t0) / steps)
            for rid in list(eng.seqs):
                eng.abort(rid)
            while eng.seqs:
                eng.step()
        decode[b] = statistics.median(per_round)
    kv = eng.kv.layout
    return {"prefill_tps": prompt_len / curve[prompt_len], "prefill_s": curve, "decode_step_s": decode, "profiled_context": context,
            "kv_bytes_per_token": kv.page_bytes * kv.num_layers / kv.block_size,
            "kv_blocks": kv.num_blocks, "block_size": kv.block_size}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="default: the built-in SmolLM2 GGUF `splitfire up` serves")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompt", type=int, default=448, help="prompt tokens for the prefill rate")
    p.add_argument("--prefill-lengths", default="64,1024,2048,3072",
                   help="prompt lengths whose whole prefill time is measured too (the cost of long prompts)")
    p.add_argument("--context", type=int, default=448, help="context tokens per stream for the decode steps")
    p.add_argument("--batches", default="1,2,4,8,16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default="")
    args = p.parse_args()
    from engine.loading.model_store import DEFAULT_MODEL, resolve_model

    model = args.model or str(resolve_model(DEFAULT_MODEL))
    res = measure(model, args.threads, args.prompt, args.context, [int(b) for b in args.batches.split(",")],
                  args.rounds, args.steps, [int(n) for n in args.prefill_lengths.split(",")])
    res = {"model": Path(model).name, "threads": args.threads, "measured": time.strftime("%Y-%m-%d"), **res}
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
