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

from engine.model_store import home

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
