"""Async scheduling (`--async-scheduling`): decode throughput of one engine in process with decode step
n+1 queued before step n's tokens are read, against the same engine stepping in order — two engines
side by side in one process, rounds alternating, medians.

Per model and batch size: B greedy streams (`ignore_eos`) of T tokens; after every prompt has its first
token, the decode phase is timed: output tokens/s, milliseconds per step, and the process's CPU time per
1,000 tokens (the host's work: on a GPU the engine thread is the process). Models: `host` (hidden 64, 2
layers: the step is nearly all host work, `random_models.host_model_dir`) and `smollm2` (random weights
of SmolLM2-135M's shape: 30 layers, a 49k vocabulary, `random_models.smollm2_shape_dir`).

    python -m loadtest.bench_async_sched                       # CUDA: host and smollm2, batches 1,16,64
    python -m loadtest.bench_async_sched --temperature 0.8     # sampled rows (top_p 0.95)
    python -m loadtest.bench_async_sched --device cpu --models host --batches 1,4 --tokens 32   # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common.sampling_params import SamplingParams
from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine
from loadtest.random_models import host_model_dir, smollm2_shape_dir

MODELS = {"host": host_model_dir, "smollm2": smollm2_shape_dir}


def engine(model: str, device: str, on: bool, max_seqs: int) -> LLMEngine:
    gpu = device == "cuda"
    return LLMEngine(EngineConfig(model=str(MODELS[model]()), device=device, dtype="bfloat16" if gpu else "float32",
                                  gpu_memory_fraction=0.2, kv_cache_gb=0.5, max_num_seqs=max_seqs,
                                  max_num_batched_tokens=max(512, 32 * max_seqs), decode_graphs="on",
                                  async_scheduling="on" if on else "off"))


def decode_round(e: LLMEngine, batch: int, tokens: int, prompt_len: int, tag: str,
                 temperature: float = 0.0) -> tuple[float, float, float]:
    """(output tokens/s, ms per step, CPU ms per 1,000 tokens) of the decode phase of one round."""
    for i in range(batch):
        prompt = [(7 * i + 13 * j) % 400 + 3 for j in range(prompt_len)]
        sampled = dict(temperature=temperature, top_p=0.95) if temperature > 0 else dict(temperature=0.0)
        e.add_request(f"{tag}-{i}", prompt, SamplingParams(max_tokens=tokens, ignore_eos=True, **sampled))
    got: dict[str, int] = {}
    while len(got) < batch or min(got.values()) < 1:  # prefill: every stream has its first token
        for o in e.step():
            got[o.request_id] = got.get(o.request_id, 0) + len(o.token_ids)
    if e.device.type == "cuda":
        torch.cuda.synchronize()
    start = sum(got.values())
    steps = 0
    t0, c0 = time.perf_counter(), time.process_time()
    while e.has_work:
        for o in e.step():
            got[o.request_id] += len(o.token_ids)
        steps += 1
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    made = sum(got.values()) - start
    assert made == batch * tokens - start, (made, batch, tokens, start)
    return made / wall, 1e3 * wall / max(steps, 1), 1e6 * cpu / made


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    p.add_argument("--models", default="host,smollm2")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--tokens", type=int, default=256, help="generated tokens per stream")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5, help="rounds per engine (alternating; medians)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampled rows (with top_p 0.95) instead of greedy")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    rows = f"temperature {args.temperature}, top_p 0.95" if args.temperature > 0 else "greedy"
    print(f"{name}; {args.tokens} tokens per stream ({rows}), prompt {args.prompt_len}, medians of {args.rounds} "
          f"alternating rounds\n")
    print(f"{'model':8} {'batch':>5} | {'in order tok/s':>14} {'queued tok/s':>12} {'ratio':>6} | "
          f"{'ms/step':>15} | {'CPU ms / 1k tok':>15}")
    for model in args.models.split(","):
        engines = {on: engine(model, args.device, on, max(batches)) for on in (False, True)}
        assert engines[True].async_scheduling and not engines[False].async_scheduling
        for b in batches:
            res: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
            decode_round(engines[False], b, 8, args.prompt_len, "warm")
            decode_round(engines[True], b, 8, args.prompt_len, "warm")
            for r in range(args.rounds):
                for on in ((False, True) if r % 2 == 0 else (True, False)):
                    res[on].append(decode_round(engines[on], b, args.tokens, args.prompt_len, f"r{r}",
                                                args.temperature))
            med = {on: [statistics.median(x[i] for x in res[on]) for i in range(3)] for on in res}
            off, on_ = med[False], med[True]
            print(f"{model:8} {b:>5} | {off[0]:>14,.0f} {on_[0]:>12,.0f} {on_[0] / off[0]:>5.2f}x | "
                  f"{off[1]:>6.2f} / {on_[1]:>6.2f} | {off[2]:>6.0f} / {on_[2]:>6.0f}", flush=True)
        del engines
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
