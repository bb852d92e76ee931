"""Tiny random models of every supported family, built by Hugging Face `transformers` itself.

Each is made with the family's own `*Config` and `*ForCausalLM`, given larger-than-default
random weights (so greedy choices are decisive, not near-ties), saved with `save_pretrained`
beside the tiny BPE tokenizer, and kept in memory as the reference: the oracle is their code,
not ours, so a misreading of a config that we share with our own reference cannot hide.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tiny_model import make_tokenizer

NONE = object()  # an override meaning "this field is None" (a plain None means "the class default")
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-5,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 50000.0}

# name -> (config class, model class, config overrides)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=LLAMA3_ROPE)),
    # The same model with config.json rewritten the way transformers 4 wrote it.
    "llama3-legacy": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=LLAMA3_ROPE)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=12)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, head_dim=None)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),  # explicit head_dim != hidden / heads
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                       mlp_only_layers=[1])),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, head_dim=None)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    # Two dense-then-MoE layers after one dense; grouped routing (4 groups, best 2), q LoRA, YaRN.
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(num_key_value_heads=4, head_dim=None, n_routed_experts=8, n_shared_experts=1,
                         num_experts_per_tok=2, moe_intermediate_size=32, n_group=4, topk_group=2,
                         first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16,
                         qk_rope_head_dim=8, v_head_dim=16, routed_scaling_factor=2.5, num_nextn_predict_layers=0,
                         rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                                          "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1,
                                          "rope_theta": 10000.0})),
    # DeepSeek-V2(-Lite): softmax routing within the best 2 of 4 groups, no q LoRA, YaRN, two shared experts.
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    dict(num_key_value_heads=4, head_dim=None, n_routed_experts=8, n_shared_experts=2,
                         num_experts_per_tok=2, moe_intermediate_size=32, n_group=4, topk_group=2,
                         topk_method="group_limited_greedy", first_k_dense_replace=1, kv_lora_rank=32,
                         q_lora_rank=NONE, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                         routed_scaling_factor=1.5,
                         rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                                          "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 10000.0})),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(sliding_window=12, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    query_pre_attn_scalar=24, final_logit_softcapping=30.0, tie_word_embeddings=True,
                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
}


@dataclass
class HFModel:
    name: str
    path: Path
    model: Any  # the transformers model, float32, eval mode
    config: dict[str, Any]

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """Last-position logits, float32."""
        return self.model(torch.tensor([ids])).logits[0, -1].float()

    @torch.no_grad()
    def greedy(self, ids: list[int], n: int) -> list[int]:
        """Greedy continuation by full recompute each step (no cache: the plainest use of their forward)."""
        ids, out = list(ids), []
        for _ in range(n):
            tok = int(self.logits(ids).argmax())
            out.append(tok)
            ids.append(tok)
        return out


def _randomize(model: torch.nn.Module, seed: int, gemma: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_((0.0 if gemma else 1.0) + 0.1 * noise)
            elif "embed" in name:
                p.copy_((0.04 if gemma else 0.3) * noise)  # Gemma multiplies embeddings by sqrt(hidden)
            elif name.endswith("gate.weight") or "router" in name:
                p.copy_(0.5 * noise)  # decisive routing: no near-ties between experts
            else:
                p.copy_(0.15 * noise)


def make_hf_model(name: str, out: Path, seed: int = 0, **overrides: Any) -> HFModel:
    import transformers

    config_cls, model_cls, extra = FAMILIES[name]
    out.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(out)
    merged = {**COMMON, **extra, **overrides, "vocab_size": vocab}
    kw = {k: v for k, v in merged.items() if v is not None and v is not NONE}
    config = getattr(transformers, config_cls)(**kw)
    for k in (k for k, v in merged.items() if v is NONE):
        setattr(config, k, None)  # a field whose None means something (DeepSeek's q_lora_rank: no q LoRA)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    _randomize(model, seed, gemma=name.startswith("gemma"))
    if config.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    if name.endswith("-legacy"):
        cfg = to_legacy_layout(cfg)
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return HFModel(name, out, model, cfg)


def to_legacy_layout(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json as transformers 4 wrote it: rope_theta beside rope_scaling, no rope_parameters."""
    cfg = dict(cfg)
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = rope
    return cfg


def make_gemma3_multimodal(out: Path, seed: int = 0) -> HFModel:
    """Gemma3ForConditionalGeneration (a vision tower beside the text model), as gemma-3-4b-it ships."""
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(out)
    _, _, text = FAMILIES["gemma3"]
    text_config = {k: v for k, v in {**COMMON, **text, "vocab_size": vocab}.items() if v is not None}
    config = transformers.Gemma3Config(
        text_config=text_config, mm_tokens_per_image=4,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14))
    config.text_config._attn_implementation = config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).float().eval()
    _randomize(model, seed, gemma=True)
    model.tie_weights()
    model.save_pretrained(out)
    return HFModel("gemma3-multimodal", out, model, json.loads((out / "config.json").read_text()))


def write_block_fp8(src: Path, dst: Path, block: int = 128) -> None:
    """`src` (a float checkpoint) as a fine-grained FP8 checkpoint in the published layout (DeepSeek-V3,
    Kimi-K2, Qwen3-*-FP8): every decoder-layer projection float8_e4m3fn with a float32 `weight_scale_inv`
    per `block` x `block` tile (amax / 448; trailing tiles partial), routers, norms, embeddings and the LM
    head left as they were, and the config's `quantization_config` saying so."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    out = {}
    for name, w in load_file(dst / "model.safetensors").items():
        if not (name.endswith(("_proj.weight", "_proj_with_mqa.weight")) and w.ndim == 2 and ".layers." in name):
            out[name] = w
            continue
        r, c = w.shape
        rb, cb = -(-r // block), -(-c // block)
        padded = torch.zeros(rb * block, cb * block)
        padded[:r, :c] = w.float()
        tiles = padded.view(rb, block, cb, block)
        scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
        codes = (tiles / scale[:, None, :, None]).view(rb * block, cb * block)[:r, :c]
        out[name] = codes.contiguous().to(torch.float8_e4m3fn)
        out[name + "_scale_inv"] = scale.float()
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [block, block]}
    (dst / "config.json").write_text(json.dumps(cfg))


def write_dequantized(src: Path, dst: Path) -> None:
    """A block-FP8 checkpoint `src` dequantized to a plain float32 one (codes x their block's scale):
    the model the FP8 weights mean, for an engine to compute without any FP8 path."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    br, bc = cfg.pop("quantization_config")["weight_block_size"]
    tensors = load_file(dst / "model.safetensors")
    out = {}
    for name, w in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        if w.dtype == torch.float8_e4m3fn:
            s = tensors[name + "_scale_inv"]
            r, c = w.shape
            w = w.float() * s.repeat_interleave(br, 0)[:r].repeat_interleave(bc, 1)[:, :c]
        out[name] = w
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg))
