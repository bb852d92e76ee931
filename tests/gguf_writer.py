"""Writing a saved Hugging Face model as a GGUF file the way llama.cpp's convert_hf_to_gguf.py does:
its metadata keys and tensor names, Q/K rows permuted for `llama`, experts stacked per layer,
Llama 3 RoPE scaling as a `rope_freqs` factor tensor, 2-D weights optionally quantized.

`deepseek2` (DeepSeek-V3) follows llama.cpp's conversion/deepseek.py: MLA metadata in its
"absorbed" form, kv_b_proj split into attn_k_b (transposed per head) and attn_v_b, the
correction bias as exp_probs_b.bias. Checked once against that converter's own output for the
tests' tiny DeepSeek-V3 (same keys, names, shapes and values; it needs llama.cpp's source tree,
so the tests use this writer)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

GGUF_ARCH = {"LlamaForCausalLM": "llama", "MixtralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
             "Qwen3ForCausalLM": "qwen3", "Qwen2MoeForCausalLM": "qwen2moe", "Qwen3MoeForCausalLM": "qwen3moe",
             "DeepseekV2ForCausalLM": "deepseek2", "DeepseekV3ForCausalLM": "deepseek2"}
LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
         "block_sparse_moe.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
         "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
         "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
         "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
         "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
         "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
         "mlp.shared_experts.down_proj": "ffn_down_shexp"}
EXPERT = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
          "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def permute(x: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's permutation of Q/K rows (half-split RoPE pairs -> interleaved)."""
    return x.reshape(n_heads, 2, x.shape[0] // n_heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf's `rope_freqs` for Llama 3.1 RoPE scaling."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high, old = rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _deepseek2_metadata(wr, cfg: dict, rope: dict) -> None:
    """What llama.cpp's DeepseekV2Model.set_gguf_parameters writes beyond the common keys."""
    import gguf

    rank, rope_dim = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    wr.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    wr.add_vocab_size(cfg["vocab_size"])
    if cfg.get("q_lora_rank") is not None:
        wr.add_q_lora_rank(cfg["q_lora_rank"])
    wr.add_kv_lora_rank(rank)
    wr.add_key_length(rank + rope_dim)
    wr.add_value_length(rank)
    wr.add_key_length_mla(cfg["qk_nope_head_dim"] + rope_dim)
    wr.add_value_length_mla(cfg["v_head_dim"])
    wr.add_expert_shared_count(cfg["n_shared_experts"])
    wr.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg.get("norm_topk_prob"):
        wr.add_expert_weights_norm(True)
    if cfg.get("n_group") is not None:
        wr.add_expert_group_count(cfg["n_group"])
    if cfg.get("topk_group") is not None:
        wr.add_expert_group_used_count(cfg["topk_group"])
    v3 = cfg["architectures"][0] == "DeepseekV3ForCausalLM"
    wr.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    wr.add_rope_dimension_count(rope_dim)
    if rope.get("rope_type") == "yarn":
        wr.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        wr.add_rope_scaling_factor(rope["factor"])
        wr.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        wr.add_rope_scaling_yarn_beta_fast(rope.get("beta_fast", 32.0))
        wr.add_rope_scaling_yarn_beta_slow(rope.get("beta_slow", 1.0))
        if rope.get("mscale_all_dim") is not None:
            wr.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def add_tokenizer(wr, model_dir: Path) -> None:
    from tokenizers import Tokenizer

    tj = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tj["added_tokens"]}
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre("gpt-2")
    wr.add_token_list(tokens)
    wr.add_token_types([3 if t in special else 1 for t in tokens])
    wr.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
    wr.add_bos_token_id(1)
    wr.add_eos_token_id(2)
    template = json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template")
    if template:
        wr.add_chat_template(template)


def write_gguf(model_dir: Path, path: Path, quantize: str | None = None, embedding_quantize: str | None = None) -> None:
    """`quantize`: GGML type of every 2-D weight; `embedding_quantize`: of the token embedding
    (llama.cpp's --token-embedding-type), default `quantize`."""
    import gguf

    cfg = json.loads((model_dir / "config.json").read_text())
    arch = GGUF_ARCH[cfg["architectures"][0]]
    w = load_file(str(model_dir / "model.safetensors"))
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if arch == "deepseek2":
        kv, head_dim = 1, 0  # MLA: llama.cpp declares one KV head; its lengths are written below
    wr = gguf.GGUFWriter(str(path), arch)
    wr.add_block_count(cfg["num_hidden_layers"])
    wr.add_context_length(cfg["max_position_embeddings"])
    wr.add_embedding_length(cfg["hidden_size"])
    wr.add_feed_forward_length(cfg["intermediate_size"])
    wr.add_head_count(heads)
    wr.add_head_count_kv(kv)
    rope = cfg.get("rope_parameters") or {"rope_theta": cfg.get("rope_theta", 10000.0)}
    if arch == "deepseek2":
        _deepseek2_metadata(wr, cfg, rope)
    else:
        wr.add_key_length(head_dim)
        wr.add_value_length(head_dim)
    wr.add_rope_freq_base(rope["rope_theta"])
    wr.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
    if experts:
        wr.add_expert_count(experts)
        wr.add_expert_used_count(cfg["num_experts_per_tok"])
        if "moe_intermediate_size" in cfg:
            wr.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if "shared_expert_intermediate_size" in cfg:
            wr.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    add_tokenizer(wr, model_dir)
    qtype = getattr(gguf.GGMLQuantizationType, quantize) if quantize else None
    etype = getattr(gguf.GGMLQuantizationType, embedding_quantize) if embedding_quantize else qtype

    def add(name: str, x: np.ndarray) -> None:
        x = np.ascontiguousarray(x.astype(np.float32))
        if name == "token_embd.weight" and etype is not None:
            wr.add_tensor(name, gguf.quants.quantize(x, etype), raw_dtype=etype)
        elif qtype is not None and x.ndim >= 2:
            wr.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
        else:
            wr.add_tensor(name, x)

    if rope.get("rope_type") == "llama3":
        add("rope_freqs.weight", llama3_rope_factors(rope, head_dim))
    add("token_embd.weight", w.pop("model.embed_tokens.weight"))
    add("output_norm.weight", w.pop("model.norm.weight"))
    if "lm_head.weight" in w and not cfg.get("tie_word_embeddings"):
        add("output.weight", w.pop("lm_head.weight"))
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name in sorted(w):
        rest = name.removeprefix("model.layers.")
        layer, rest = rest.split(".", 1)
        base, kind = rest.rsplit(".", 1)
        x = w[name]
        if base == "self_attn.kv_b_proj":
            per_head = x.reshape(heads, cfg["qk_nope_head_dim"] + cfg["v_head_dim"], -1)
            add(f"blk.{layer}.attn_k_b.weight", per_head[:, : cfg["qk_nope_head_dim"]].transpose(0, 2, 1))
            add(f"blk.{layer}.attn_v_b.weight", per_head[:, cfg["qk_nope_head_dim"] :])
            continue
        if base == "mlp.gate" and kind == "e_score_correction_bias":
            add(f"blk.{layer}.exp_probs_b.bias", x)
            continue
        if ".experts." in base:
            e, proj = base.rsplit(".", 2)[1:]
            stacks.setdefault(f"blk.{layer}.{EXPERT[proj]}.{kind}", {})[int(e)] = x
            continue
        if arch == "llama" and base in ("self_attn.q_proj", "self_attn.k_proj") and kind == "weight":
            x = permute(x, heads if base == "self_attn.q_proj" else kv)
        if base == "mlp.shared_expert_gate":
            x = x[0]  # llama.cpp stores this [1, hidden] gate as a vector
        add(f"blk.{layer}.{LAYER[base]}.{kind}", x)
    for name, per_expert in stacks.items():
        add(name, np.stack([per_expert[e] for e in range(len(per_expert))]))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
