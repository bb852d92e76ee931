"""LoRA adapters' cost (`python -m loadtest.bench_engine --lora`): decode tokens/s at batch 16 with the
16 requests spread over 8 rank-16 adapters against the same batch on the base alone, the same for a
512-token prefill, and the time to load an adapter. Adapters are random (every attention and MLP
projection targeted, written in the PEFT layout here), on the model under test (SmolLM2 by default).
Rounds alternate the variants; medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from common.sampling_params import SamplingParams
from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loading.model_store import resolve_model
from engine.model.model_config import ModelConfig
from loadtest.engine_runs import decode_rate, ours_prefill, random_ids

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(out: Path, cfg: ModelConfig, rank: int, seed: int) -> Path:
    """A random PEFT adapter for `cfg`'s model: every projection of every layer, B not zero."""
    from safetensors.torch import save_file

    h, d = cfg.hidden_size, cfg.head_dim
    shapes = {"q_proj": (h, cfg.num_heads * d), "k_proj": (h, cfg.num_kv_heads * d),
              "v_proj": (h, cfg.num_kv_heads * d), "o_proj": (cfg.num_heads * d, h),
              "gate_proj": (h, cfg.intermediate_size), "up_proj": (h, cfg.intermediate_size),
              "down_proj": (cfg.intermediate_size, h)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(cfg.num_layers):
        for name, (n_in, n_out) in shapes.items():
            part = "self_attn" if name[0] in "qkvo" else "mlp"
            key = f"base_model.model.model.layers.{i}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) / n_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                         "target_modules": list(TARGETS)}))
    return out


def main_lora(args: argparse.Namespace) -> int:
    model_dir = resolve_model(args.model)
    cfg = ModelConfig.from_dir(model_dir)
    n_adapters, rank, batch = args.lora_adapters, args.lora_rank, 16
    tmp = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    paths = {f"a{i}": write_adapter(tmp / f"a{i}", cfg, rank, i) for i in range(n_adapters)}

    def engine(lora: bool) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(model_dir), device="cpu", threads=args.threads, kv_cache_gb=1.0,
                                      max_num_batched_tokens=1024, speculative="off", enable_lora=lora,
                                      max_loras=n_adapters, max_lora_rank=rank, lora_dtype=args.lora_dtype))

    base, lora = engine(False), engine(True)
    load_s = []
    for name, path in paths.items():
        t0 = time.perf_counter()
        lora.load_adapter(name, str(path))
        load_s.append(time.perf_counter() - t0)
    names = list(paths)
    vocab = cfg.vocab_size
    sp = SamplingParams(max_tokens=args.lora_tokens + 2, temperature=0, ignore_eos=True)
    rows: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for label, eng, ads in (("base", base, []), ("LoRA on, base rows", lora, []), ("adapters", lora, names)):
            prompts = [random_ids(vocab, 32, r * 1000 + i) for i in range(batch)]
            rows.setdefault(f"decode|{label}", []).append(decode_rate(eng, prompts, sp, f"d{r}{label}", ads))
            rows.setdefault(f"prefill|{label}", []).append(
                ours_prefill(eng, random_ids(vocab, 512, 100 + r), 100 + r, ads[r % len(ads)] if ads else ""))
    med = {k: statistics.median(v) for k, v in rows.items()}
    quant = "quantized weights as stored" if (model_dir / "splitfire_format").exists() else "float weights"
    print(f"\nLoRA: {cfg.num_layers}-layer {model_dir.name} ({quant}), {args.threads} threads; {n_adapters} adapters of "
          f"rank {rank} on all 7 projections, --lora-dtype {args.lora_dtype}; medians of {args.rounds} rounds")
    print(f"{'':<34}{'base':>12}{'LoRA on, base rows':>20}{f'{n_adapters} adapters':>12}{'adapters/base':>15}")
    for what, label in (("decode", f"decode batch {batch} tok/s"), ("prefill", "prefill 512 tok/s")):
        b, on, ad = med[f"{what}|base"], med[f"{what}|LoRA on, base rows"], med[f"{what}|adapters"]
        print(f"{label:<34}{b:>12.1f}{on:>20.1f}{ad:>12.1f}{ad / b:>15.2f}")
    print(f"adapter load (read + place), median of {n_adapters}: {statistics.median(load_s) * 1e3:.1f} ms "
          f"({sum(a.nbytes for a in lora.loras.adapters.values()) / n_adapters / 2**20:.1f} MiB each)"
          if lora.loras is not None else "")
    return 0
