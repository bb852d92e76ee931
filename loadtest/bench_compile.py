"""torch.compile (inductor, CPU) against the engine's own decode paths, one run (issue #18 item 2).

Batch-1 greedy decode of SmolLM2-135M (64-token prompt, 48 tokens), medians of --rounds, rows:
  float32, oneDNN-packed weights (the float32 default)       eager
  float32, plain weights (F.linear)                            eager
  float32, plain weights, each block's MLP and norms compiled  torch.compile (dynamic=False), + compile time
  Q4_1 as stored (the default model), the C layer loop        eager
Inductor cannot lower the packed oneDNN linear (`mkldnn._linear_pointwise` on a reordered weight:
LoweringException), so the compiled row starts from plain weights; the C kernels (SiLU x up,
attention) are opaque to it and break the graph. The row is what a user of torch.compile on
this engine would get; it is not used by the engine.

    python -m loadtest.bench_compile
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import engine.model.decoder
from common.sampling_params import SamplingParams
from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loading.model_store import DEFAULT_MODEL, fetch_builtin
from loadtest.bench_quant import cpu_flags
from loadtest.engine_runs import decode_rate, prompt_ids


def _engine(path: str, threads: int, packed: bool) -> LLMEngine:
    saved = engine.model.decoder.cpu_packing_supported
    if not packed:
        engine.model.decoder.cpu_packing_supported = lambda dtype: False  # type: ignore[assignment]
    try:
        return LLMEngine(EngineConfig(model=path, device="cpu", threads=threads, kv_cache_gb=0.5))
    finally:
        engine.model.decoder.cpu_packing_supported = saved  # type: ignore[assignment]


def _rate(eng: LLMEngine, rounds: int, tag: str) -> float:
    sp = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    prompts = [prompt_ids(eng.tokenizer, 64, salt=1)]
    decode_rate(eng, prompts, sp, f"{tag}-warm")
    return statistics.median(decode_rate(eng, prompts, sp, f"{tag}-{i}") for i in range(rounds))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    floats = str(fetch_builtin(DEFAULT_MODEL, keep_quantized=False))
    rows: list[tuple[str, float, str]] = []
    rows.append(("float32, oneDNN-packed (default), eager", _rate(_engine(floats, args.threads, True), args.rounds, "pk"),
                 ""))
    plain = _engine(floats, args.threads, False)
    rows.append(("float32, plain weights, eager", _rate(plain, args.rounds, "pl"), ""))
    t0 = time.perf_counter()
    for block in plain.model.layers:  # type: ignore[attr-defined]
        block.mlp = torch.compile(block.mlp, dynamic=False)
        block.attn_norm = torch.compile(block.attn_norm, dynamic=False)
        block.mlp_norm = torch.compile(block.mlp_norm, dynamic=False)
    rate = _rate(plain, args.rounds, "co")  # (its warm-up round compiles)
    rows.append(("float32, plain weights, MLP + norms compiled", rate,
                 f"compile + first rounds {time.perf_counter() - t0:.1f} s"))
    q = _engine(str(fetch_builtin(DEFAULT_MODEL)), args.threads, True)
    rows.append(("Q4_1 as stored (default), C layer loop", _rate(q, args.rounds, "q"), ""))
    print(f"\nSmolLM2-135M-Instruct, batch-1 greedy decode, CPU: {cpu_flags()}; medians of {args.rounds}",
          file=sys.stdout)
    base = rows[0][1]
    print(f"{'':<48}{'tok/s':>8}{'vs default float32':>20}")
    for name, r, note in rows:
        print(f"{name:<48}{r:>8.1f}{r / base:>19.2f}x  {note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
