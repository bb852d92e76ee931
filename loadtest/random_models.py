"""Same-size random-weight models of every family, for engine benchmarks.

Built once by transformers' own config and model classes (the `bench` extra installs it) and
cached under `$SPLITFIRE_HOME/bench-models/<family>`. Every dense family gets the same shape;
the mixture-of-experts ones get the same *active* parameters per token (Qwen3-MoE: 8 of 64
experts of 256; Mixtral: 2 of 8 experts of 1024), so a step-time ratio against the dense model
of the same family measures what routing and expert grouping cost.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from engine.loading.model_store import home

SHAPE = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
             vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-6)
DENSE_INTERMEDIATE = 2048
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(intermediate_size=DENSE_INTERMEDIATE)),
    "mistral": ("MistralConfig", dict(intermediate_size=DENSE_INTERMEDIATE, sliding_window=1024)),
    "qwen2": ("Qwen2Config", dict(intermediate_size=DENSE_INTERMEDIATE)),
    "qwen3": ("Qwen3Config", dict(intermediate_size=DENSE_INTERMEDIATE)),
    "gemma3": ("Gemma3TextConfig", dict(intermediate_size=DENSE_INTERMEDIATE, sliding_window=512,
                                        query_pre_attn_scalar=64)),
    "mixtral": ("MixtralConfig", dict(intermediate_size=DENSE_INTERMEDIATE // 2, num_local_experts=8,
                                      num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=DENSE_INTERMEDIATE, moe_intermediate_size=256,
                                         num_experts=64, num_experts_per_tok=8, norm_topk_prob=True)),
    # DeepSeek-V3's proportions at this hidden size: latent rank 256 + 32 RoPE dims per token and
    # layer (V3: 512 + 64 at 7168), q LoRA, 8 of 64 routed experts in 8 groups (best 4) + 1 shared.
    "deepseek_v3": ("DeepseekV3Config", dict(intermediate_size=DENSE_INTERMEDIATE, moe_intermediate_size=256,
                                             n_routed_experts=64, num_experts_per_tok=8, n_group=8, topk_group=4,
                                             n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=256,
                                             q_lora_rank=384, qk_nope_head_dim=64, qk_rope_head_dim=32,
                                             v_head_dim=64, head_dim=None, num_key_value_heads=16,
                                             num_nextn_predict_layers=0)),
}
# Each MoE family and the dense family with its active parameter count (and attention).
MOE_BASELINES = {"qwen3_moe": "qwen3", "mixtral": "mistral"}


def _write_tokenizer(out: Path, vocab: int) -> None:
    """A word-level vocabulary of `vocab` placeholder tokens: enough for the engine's detokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                           "eos_token": "t1", "bos_token": "t0"}))


def model_dir(family: str) -> Path:
    target = home() / "bench-models" / family
    if (target / "config.json").is_file():
        return target
    import torch
    import transformers

    config_cls, extra = FAMILIES[family]
    print(f"building a random {family} model with transformers ...", file=sys.stderr, flush=True)
    config = getattr(transformers, config_cls)(**{k: v for k, v in {**SHAPE, **extra}.items() if v is not None})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{family}."))
    try:
        model.save_pretrained(tmp)
        _write_tokenizer(tmp, SHAPE["vocab_size"])
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def host_model_dir() -> Path:
    """A random Llama whose compute is negligible (hidden 64, 2 layers, a 512-token vocabulary) with
    SmolLM2's tokenizer and chat template: serving it measures the host's work per token (scheduling,
    bookkeeping, detokenizing, streaming), not the model's (`bench_host.py`)."""
    target = home() / "bench-models" / "host-llama"
    if (target / "config.json").is_file():
        return target
    import torch
    import transformers

    from engine.loading.model_store import resolve_model

    smol = resolve_model(None)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                      max_position_embeddings=8192, tie_word_embeddings=True,
                                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return _save_with_tokenizer(transformers.AutoModelForCausalLM.from_config(config), target, smol)


def smollm2_shape_dir() -> Path:
    """Random weights of SmolLM2-135M's shape (30 layers, hidden 576, 9 heads, 3 KV heads, its 49k
    vocabulary) with SmolLM2's tokenizer taken from `host_model_dir()`: a small model whose step is
    the device's work, not the host's (`bench_async_sched.py`)."""
    target = home() / "bench-models" / "smollm2-shape"
    if (target / "config.json").is_file():
        return target
    import torch
    import transformers

    host = host_model_dir()
    config = transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                      num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                      max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=100000.0,
                                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return _save_with_tokenizer(transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16), target,
                                host)


def _save_with_tokenizer(model: Any, target: Path, tokenizer_dir: Path) -> Path:
    """`model` saved (transformers) with `tokenizer_dir`'s tokenizer files as `target`, made whole in a
    temporary directory beside it and renamed into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        model.save_pretrained(tmp)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tokenizer_dir / name).is_file():
                shutil.copy(tokenizer_dir / name, tmp / name)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def write_eagle3_head(out: Path, target_dir: Path, *, aux: tuple[int, ...] | None = None, draft_vocab: int = 150,
                      seed: int = 3, embed: bool = False, norm_before_residual: bool = False,
                      extra: dict[str, Any] | None = None) -> Path:
    """A randomly initialised EAGLE-3 head for the target in `target_dir`, in the published Hugging Face
    layout (LlamaForCausalLMEagle3: fc, midlayer.*, norm, lm_head over `draft_vocab` of the target's ids,
    d2t, t2d; embed_tokens with `embed`). No trained head exists for the models here: a random one
    proposes tokens the target rarely accepts, so it measures the cost of EAGLE-3 drafting, and (in
    tests) that output stays the target's."""
    import torch
    from safetensors.torch import save_file

    t_cfg = json.loads((target_dir / "config.json").read_text())
    hidden, heads = t_cfg["hidden_size"], t_cfg["num_attention_heads"]
    kv_heads, inter, vocab = t_cfg.get("num_key_value_heads", heads), t_cfg["intermediate_size"], t_cfg["vocab_size"]
    d = t_cfg.get("head_dim") or hidden // heads
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    n_aux = len(aux) if aux else 3
    # The draft vocabulary: draft_vocab of the target's ids, ascending (EAGLE-3's training picks the
    # most frequent ones); d2t[i] = target id - i.
    chosen = torch.sort(torch.randperm(vocab - 3, generator=g)[:draft_vocab] + 3).values
    p = "midlayer."
    t = {"fc.weight": rnd(hidden, n_aux * hidden, scale=0.2 / n_aux ** 0.5),
         p + "input_layernorm.weight": 1 + rnd(hidden, scale=0.1), p + "hidden_norm.weight": 1 + rnd(hidden, scale=0.1),
         p + "post_attention_layernorm.weight": 1 + rnd(hidden, scale=0.1),
         p + "self_attn.q_proj.weight": rnd(heads * d, 2 * hidden), p + "self_attn.k_proj.weight": rnd(kv_heads * d, 2 * hidden),
         p + "self_attn.v_proj.weight": rnd(kv_heads * d, 2 * hidden), p + "self_attn.o_proj.weight": rnd(hidden, heads * d),
         p + "mlp.gate_proj.weight": rnd(inter, hidden), p + "mlp.up_proj.weight": rnd(inter, hidden),
         p + "mlp.down_proj.weight": rnd(hidden, inter), "norm.weight": 1 + rnd(hidden, scale=0.1),
         "lm_head.weight": rnd(draft_vocab, hidden, scale=0.5), "d2t": chosen - torch.arange(draft_vocab),
         "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, chosen, True)}
    if embed:
        t["embed_tokens.weight"] = rnd(vocab, hidden, scale=0.3)
    save_file({k: v.contiguous() for k, v in t.items()}, str(out / "model.safetensors"))
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": d,
           "num_hidden_layers": 1, "rms_norm_eps": t_cfg.get("rms_norm_eps", 1e-5),
           "rope_theta": t_cfg.get("rope_theta", 10000.0), "max_position_embeddings": t_cfg["max_position_embeddings"],
           "vocab_size": vocab, "draft_vocab_size": draft_vocab, "hidden_act": "silu", "tie_word_embeddings": False,
           "norm_before_residual": norm_before_residual, **(extra or {})}
    if aux:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux), "use_aux_hidden_state": True}
    (out / "config.json").write_text(json.dumps(cfg))
    return out
