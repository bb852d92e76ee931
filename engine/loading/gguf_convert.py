"""Converting a GGUF file into a Hugging Face model directory, once.

The converted directory is then loaded by the same code as any safetensors checkpoint.
Matmul weights in Q8_0 / Q5_0 / Q6_K / Q4_0 / Q4_1 / Q4_K stay quantized: their blocks are
re-expressed exactly in `engine.model.quant`'s int8/int4 layout (`gguf_quants.py`), so a 4-bit file
serves at 4 bits. Everything else (norms, stacked experts, other types, or every tensor with
`keep_quantized=False`) is dequantized (numpy, via the `gguf` package) to float32. Output goes
into ~1 GiB shards with an index, so conversion holds one shard in memory, not the model. What differs from the Hugging Face
layout is undone: llama.cpp permutes Q and K rows of `llama`-architecture models for its
interleaved RoPE (permuted back here), stacks each layer's experts into one tensor (split
back per expert), and stores Llama 3.1 RoPE scaling as a `rope_freqs` factor tensor
(recognised as the `llama3` rope type it was computed from, or refused).

Architectures: llama (dense, or with experts: Mixtral), qwen2, qwen3, qwen2moe, qwen3moe.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from common.errors import ModelLoadError
from engine.loading import gguf_quants
from engine.model.quant import QUANT_METHOD
from engine.model.rope import RopeSpec

_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4
_SHARD_BYTES = 1 << 30

# GGUF architecture -> (HF architecture when dense, when it has experts)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "MixtralForCausalLM"),
    "qwen2": ("Qwen2ForCausalLM", None),
    "qwen3": ("Qwen3ForCausalLM", None),
    "qwen2moe": (None, "Qwen2MoeForCausalLM"),
    "qwen3moe": (None, "Qwen3MoeForCausalLM"),
    "deepseek2": ("DeepseekV3ForCausalLM", "DeepseekV3ForCausalLM"),  # or V2, by its gating: _deepseek2_config
}
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MixtralForCausalLM": "mixtral", "Qwen2ForCausalLM": "qwen2",
                "Qwen3ForCausalLM": "qwen3", "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe"}
# Pre-tokenizer regexes of the byte-level BPE vocabularies llama.cpp names in `tokenizer.ggml.pre`
# (the same patterns the models' own tokenizer.json files carry).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    "llama-bpe": (_LLAMA3_SPLIT,), "llama3": (_LLAMA3_SPLIT,),
    "qwen2": (_LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}"),),
    # DeepSeek-V3 / R1: numbers, then CJK runs, then words and punctuation (its tokenizer.json's three Splits).
    "deepseek-v3": (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
                    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}

# Per-layer GGUF tensor name -> Hugging Face name (after "model.layers.{i}.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    # deepseek2 (multi-head latent attention)
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "exp_probs_b": "mlp.gate.e_score_correction_bias",
}
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_MIXTRAL_EXPERTS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: interleaved rotary pairs back to two halves."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _build_tokenizer(reader: Any, out_dir: Path, context_length: int) -> dict[str, Any]:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(
            f"GGUF tokenizer type {kind!r} is not supported (only byte-level BPE 'gpt2'); "
            "use the model's Hugging Face directory instead"
        )
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    types: list[int] = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    pre = _field(reader, "tokenizer.ggml.pre")
    if pre in _PRE_SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            *(pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE_SPLITS[pre]),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    elif pre in ("smollm", "starcoder", "refact"):
        # These split every digit on its own before the GPT-2 regex (llama.cpp does the same).
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False)])
    elif pre in (None, "default", "gpt-2", "gpt2"):
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        raise ModelLoadError(f"GGUF pre-tokenizer {pre!r} is not supported (supported: "
                             f"{sorted([*_PRE_SPLITS, 'smollm', 'starcoder', 'refact', 'gpt-2'])}); "
                             "use the model's Hugging Face directory instead")
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [t for t, ty in zip(tokens, types, strict=True) if ty in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.save(str(out_dir / "tokenizer.json"))

    template = _field(reader, "tokenizer.chat_template")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    # Some GGUFs (this SmolLM2 one included) name <|im_start|> as EOS; the chat template's
    # end-of-turn marker is what instruct models actually emit.
    eot = next((tokens.index(t) for t in _END_OF_TURN if template and t in template and t in tokens), None)
    eos_ids = [i for i in (eot, eos) if i is not None and i != bos] or ([eos] if eos is not None else [])
    eos_ids = list(dict.fromkeys(eos_ids))
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
    }
    if bos is not None:
        cfg["bos_token"] = tokens[bos]
    if eos_ids:
        cfg["eos_token"] = tokens[eos_ids[0]]
        cfg["pad_token"] = tokens[eos_ids[0]]
    unk = _field(reader, "tokenizer.ggml.unknown_token_id")
    if unk is not None:
        cfg["unk_token"] = tokens[unk]
    if template:
        cfg["chat_template"] = template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    return {"bos_token_id": bos, "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids, "vocab": len(tokens)}


def llama3_rope_from_factors(factors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any]:
    """The `llama3` rope_scaling that llama.cpp's `rope_freqs` tensor was computed from (Llama 3.1:
    factor 8, Llama 3.2: factor 32; low/high frequency factors 1/4 over an 8192-token original
    context), or a ModelLoadError: other factor tensors have no Hugging Face rope type."""
    base = RopeSpec("default", theta).inv_freq(head_dim).numpy()
    for factor in (8.0, 16.0, 32.0, 4.0, 2.0):
        params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}
        spec = RopeSpec("llama3", theta, factor=factor, original_max_position_embeddings=8192)
        expected = base / spec.inv_freq(head_dim).numpy()
        if factors.shape == expected.shape and np.allclose(factors, expected, rtol=1e-4):
            return params
    raise ModelLoadError("rope_freqs.weight does not match Llama 3 rope scaling with any standard factor; "
                         "use the model's Hugging Face directory instead")


class _ShardWriter:
    """Writes tensors into model-0000i.safetensors files of about `_SHARD_BYTES`, then the index."""

    def __init__(self, out_dir: Path, source: str):
        self.out_dir, self.source = out_dir, source
        self.pending: dict[str, np.ndarray] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []

    def add(self, name: str, array: np.ndarray) -> None:
        self.pending[name] = np.ascontiguousarray(array)
        self.pending_bytes += array.nbytes
        if self.pending_bytes >= _SHARD_BYTES:
            self._flush()

    def _flush(self) -> None:
        from safetensors.numpy import save_file

        if not self.pending:
            return
        self.shards.append(list(self.pending))
        save_file(self.pending, str(self.out_dir / f"shard-{len(self.shards):05d}.safetensors"),
                  metadata={"format": "pt", "source": self.source})
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        self._flush()
        n = len(self.shards)
        weight_map: dict[str, str] = {}
        for i, names in enumerate(self.shards, 1):
            final = f"model-{i:05d}-of-{n:05d}.safetensors"
            (self.out_dir / f"shard-{i:05d}.safetensors").rename(self.out_dir / final)
            weight_map.update(dict.fromkeys(names, final))
        (self.out_dir / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"source": self.source}, "weight_map": weight_map}, indent=1))


def _config(reader: Any, arch: str, names: set[str], tok_info: dict[str, Any], source: Path) -> dict[str, Any]:
    def k(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    n_experts = int(k("expert_count", 0) or 0)
    dense, moe = ARCHITECTURES[arch]
    hf_arch = moe if n_experts else dense
    if hf_arch is None:
        raise ModelLoadError(f"{source}: GGUF architecture {arch!r} {'with' if n_experts else 'without'} experts "
                             "is not supported")
    if arch == "deepseek2":
        return _deepseek2_config(k, names, tok_info, source)
    n_heads = int(k("attention.head_count"))
    n_kv = int(k("attention.head_count_kv", n_heads))
    hidden = int(k("embedding_length"))
    head_dim = int(k("attention.key_length", hidden // n_heads))
    context = int(k("context_length", 2048))
    theta = float(k("rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": _MODEL_TYPES[hf_arch],
        "vocab_size": tok_info["vocab"],
        "hidden_size": hidden,
        "intermediate_size": int(k("feed_forward_length", 0) or k("expert_feed_forward_length", 0)),
        "num_hidden_layers": int(k("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": float(k("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": theta,
        "max_position_embeddings": context,
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "bos_token_id": tok_info["bos_token_id"],
        "eos_token_id": tok_info["eos_token_id"],
    }
    if hf_arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        config["use_sliding_window"] = False
    if arch in ("qwen3", "qwen3moe"):
        config["attention_bias"] = "blk.0.attn_q.bias" in names
    if arch == "qwen2moe":
        config["qkv_bias"] = "blk.0.attn_q.bias" in names
    if n_experts:
        config["num_local_experts" if hf_arch == "MixtralForCausalLM" else "num_experts"] = n_experts
        config["num_experts_per_tok"] = int(k("expert_used_count"))
        if hf_arch != "MixtralForCausalLM":
            config["moe_intermediate_size"] = int(k("expert_feed_forward_length"))
            config["norm_topk_prob"] = bool(k("expert_weights_norm", arch == "qwen3moe"))
            config["decoder_sparse_step"] = 1
            # Layers without a router are dense (Qwen's mlp_only_layers).
            config["mlp_only_layers"] = [i for i in range(config["num_hidden_layers"])
                                         if f"blk.{i}.ffn_gate_inp.weight" not in names]
        if arch == "qwen2moe":
            config["shared_expert_intermediate_size"] = int(k("expert_shared_feed_forward_length"))
    scaling = k("rope.scaling.type")
    if scaling in ("linear", "yarn"):
        config["rope_scaling"] = {"rope_type": scaling, "factor": float(k("rope.scaling.factor"))}
        if scaling == "yarn":
            config["rope_scaling"]["original_max_position_embeddings"] = int(k("rope.scaling.original_context_length"))
    elif scaling not in (None, "none"):
        raise ModelLoadError(f"{source}: GGUF rope scaling {scaling!r} is not supported")
    if k("attention.sliding_window") is not None:
        raise ModelLoadError(f"{source}: GGUF {arch}.attention.sliding_window is not supported")
    return config


# llama.cpp's expert_gating_func for deepseek2: absent or 1 = softmax (DeepSeek-V2), 2 = sigmoid (V3).
_SOFTMAX_GATING, _SIGMOID_GATING = 1, 2


def _deepseek2_config(k: Any, names: set[str], tok_info: dict[str, Any], source: Path) -> dict[str, Any]:
    """DeepSeek-V2 / V3 / Kimi-K2 as llama.cpp's converter writes them: MLA in the "absorbed" form
    (key_length = kv_lora_rank + rope dims, the per-head sizes in key_length_mla / value_length_mla;
    files from before that change carry the per-head sizes in key_length / value_length), the YaRN
    mscale as `yarn_log_multiplier` = 0.1 * mscale_all_dim."""
    gating = int(k("expert_gating_func", _SOFTMAX_GATING))
    if gating not in (_SOFTMAX_GATING, _SIGMOID_GATING):
        raise ModelLoadError(f"{source}: deepseek2 expert_gating_func={gating} is not supported (1 softmax: "
                             "DeepSeek-V2 / V2.5; 2 sigmoid: DeepSeek-V3 / R1, Kimi-K2)")
    v3 = gating == _SIGMOID_GATING
    rope_dim = int(k("rope.dimension_count"))
    if k("attention.key_length_mla") is not None:
        nope, v_dim = int(k("attention.key_length_mla")) - rope_dim, int(k("attention.value_length_mla"))
    else:
        nope, v_dim = int(k("attention.key_length")) - rope_dim, int(k("attention.value_length"))
    layers, n_heads = int(k("block_count")), int(k("attention.head_count"))
    experts = int(k("expert_count", 0) or 0)
    q_rank = k("attention.q_lora_rank")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(k("rope.freq_base", 10000.0))}
    scaling = k("rope.scaling.type")
    if scaling == "yarn":
        # llama.cpp leaves cos/sin unscaled for deepseek2 (its attn_factor cancels YaRN's) and puts
        # mscale(factor, mscale_all_dim)^2 into the softmax scale: attention_factor 1, and mscale_all_dim.
        rope.update(rope_type="yarn", factor=float(k("rope.scaling.factor")), attention_factor=1.0,
                    original_max_position_embeddings=int(k("rope.scaling.original_context_length")),
                    beta_fast=float(k("rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=float(k("rope.scaling.yarn_beta_slow", 1.0)))
        log_mul = k("rope.scaling.yarn_log_multiplier")
        if log_mul:
            rope["mscale_all_dim"] = float(log_mul) / 0.1
    elif scaling not in (None, "none"):
        raise ModelLoadError(f"{source}: GGUF rope scaling {scaling!r} is not supported")
    groups = int(k("expert_group_count", 1) or 1)
    routing = ({"scoring_func": "sigmoid", "topk_method": "noaux_tc"} if v3 else
               {"scoring_func": "softmax", "topk_method": "group_limited_greedy" if groups > 1 else "greedy"})
    return {
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if v3 else "deepseek_v2", **routing,
        "vocab_size": tok_info["vocab"], "hidden_size": int(k("embedding_length")),
        "intermediate_size": int(k("feed_forward_length")), "num_hidden_layers": layers,
        "num_attention_heads": n_heads, "num_key_value_heads": n_heads,
        "q_lora_rank": int(q_rank) if q_rank else None, "kv_lora_rank": int(k("attention.kv_lora_rank")),
        "qk_nope_head_dim": nope, "qk_rope_head_dim": rope_dim, "v_head_dim": v_dim, "rope_interleave": True,
        "first_k_dense_replace": int(k("leading_dense_block_count", 0) or 0) if experts else layers,
        "n_routed_experts": experts or 1, "num_experts_per_tok": int(k("expert_used_count", 1) or 1),
        "moe_intermediate_size": int(k("expert_feed_forward_length", 1) or 1),
        "n_shared_experts": int(k("expert_shared_count", 0) or 0),
        "routed_scaling_factor": float(k("expert_weights_scale", 1.0) or 1.0),
        "norm_topk_prob": bool(k("expert_weights_norm", False)),
        "n_group": groups, "topk_group": int(k("expert_group_used_count", 1) or 1),
        "rms_norm_eps": float(k("attention.layer_norm_rms_epsilon", 1e-6)), "rope_parameters": rope,
        "max_position_embeddings": int(k("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names, "hidden_act": "silu", "torch_dtype": "float32",
        "bos_token_id": tok_info["bos_token_id"], "eos_token_id": tok_info["eos_token_id"],
    }


def convert_gguf(gguf_path: Path, out_dir: Path, keep_quantized: bool = True) -> None:
    """Write config.json, sharded safetensors and the tokenizer files for `gguf_path` into `out_dir`."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except Exception as e:
        raise ModelLoadError(f"{gguf_path}: not a readable GGUF file: {e}") from e
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{gguf_path}: unsupported GGUF architecture {arch!r} (supported: {sorted(ARCHITECTURES)})")
    names = {t.name for t in reader.tensors}
    tok_info = _build_tokenizer(reader, out_dir, int(_field(reader, f"{arch}.context_length", 2048)))
    config = _config(reader, arch, names, tok_info, gguf_path)
    mixtral = config["architectures"][0] == "MixtralForCausalLM"
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    writer = _ShardWriter(out_dir, gguf_path.name)
    quantized = 0
    mla_halves: dict[str, dict[str, np.ndarray]] = {}  # layer -> attn_k_b / attn_v_b until both are read
    for t in tqdm(reader.tensors, desc=f"converting {gguf_path.name}", unit="tensor", disable=None):
        if _beyond_layers(t.name, config["num_hidden_layers"]):
            continue  # DeepSeek's multi-token-prediction layer (blk.{n}.nextn.*): not used for decoding
        parts = _quantized_parts(t) if keep_quantized else None
        if parts is not None:
            for key, array in parts.items():
                for hf, a in _hf_tensors(t.name, array, arch, mixtral, n_heads, n_kv, gguf_path):
                    writer.add(f"{hf}.{key}", a)
            quantized += 1
            continue
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        if t.name == "rope_freqs.weight":
            config["rope_scaling"] = llama3_rope_from_factors(w, config["rope_theta"], config["head_dim"])
            continue
        if t.name.endswith((".attn_k_b.weight", ".attn_v_b.weight")):
            layer = t.name.split(".")[1]
            mla_halves.setdefault(layer, {})[t.name.split(".")[2]] = w
            if len(mla_halves[layer]) == 2:
                writer.add(f"model.layers.{layer}.self_attn.kv_b_proj.weight", _kv_b(mla_halves.pop(layer)))
            continue
        for hf, array in _hf_tensors(t.name, w, arch, mixtral, n_heads, n_kv, gguf_path):
            writer.add(hf, array)
    if mla_halves:
        raise ModelLoadError(f"{gguf_path}: layers {sorted(mla_halves)} have attn_k_b without attn_v_b or the reverse")
    writer.close()
    if quantized:
        config["quantization_config"] = {"quant_method": QUANT_METHOD, "source": "gguf"}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))


def _beyond_layers(name: str, num_layers: int) -> bool:
    parts = name.split(".")
    return parts[0] == "blk" and int(parts[1]) >= num_layers


def _kv_b(halves: dict[str, np.ndarray]) -> np.ndarray:
    """kv_b_proj [heads * (nope + v), rank] from llama.cpp's split: attn_k_b [heads, rank, nope]
    (transposed for absorption) and attn_v_b [heads, v, rank]."""
    k_b, v_b = halves["attn_k_b"], halves["attn_v_b"]
    kv = np.concatenate((k_b.transpose(0, 2, 1), v_b), axis=1)
    return np.ascontiguousarray(kv.reshape(-1, kv.shape[-1]))


def _quantized_parts(t: Any) -> dict[str, np.ndarray] | None:
    """A matmul weight whose GGML type `gguf_quants` re-expresses exactly, in that layout: 2-D, or
    stacked experts [E, rows, cols] (each part then stacked per expert the same way)."""
    if not t.name.endswith(".weight") or len(t.shape) not in (2, 3):
        return None
    if t.name.split(".")[-2] in ("ffn_gate_inp", "ffn_gate_inp_shexp"):
        return None  # routers stay float (see DecoderModel.quantize)
    data = np.asarray(t.data)
    if len(t.shape) == 2:
        cols, rows = (int(d) for d in t.shape)
        return gguf_quants.convert(data, t.tensor_type.name, rows, cols)
    if t.name.split(".")[-2] not in _EXPERTS:
        return None
    cols, rows, experts = (int(d) for d in t.shape)
    per_expert = [gguf_quants.convert(data[e], t.tensor_type.name, rows, cols) for e in range(experts)]
    if any(p is None for p in per_expert):
        return None
    return {key: np.stack([p[key] for p in per_expert if p is not None]) for key in per_expert[0] or {}}


def _hf_tensors(name: str, w: np.ndarray, arch: str, mixtral: bool, n_heads: int, n_kv: int,
                source: Path) -> list[tuple[str, np.ndarray]]:
    """The Hugging Face tensors that GGUF tensor `name` holds (experts: one per expert)."""
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    if name in top:
        return [(top[name], w)]
    parts = name.split(".")
    if parts[0] != "blk" or len(parts) != 4:
        raise ModelLoadError(f"{source}: unexpected tensor {name!r}")
    layer, base, kind = parts[1], parts[2], parts[3]
    prefix = f"model.layers.{layer}."
    if base in _EXPERTS:
        proj = _EXPERTS[base]
        if mixtral:
            return [(f"{prefix}block_sparse_moe.experts.{e}.{_MIXTRAL_EXPERTS[proj]}.{kind}", w[e])
                    for e in range(w.shape[0])]
        return [(f"{prefix}mlp.experts.{e}.{proj}.{kind}", w[e]) for e in range(w.shape[0])]
    if base not in _LAYER_NAMES:
        raise ModelLoadError(f"{source}: unexpected tensor {name!r}")
    hf = _LAYER_NAMES[base]
    if mixtral and base == "ffn_gate_inp":
        hf = "block_sparse_moe.gate"
    if arch == "deepseek2" and base.endswith("_shexp"):
        hf = hf.replace("shared_expert.", "shared_experts.")  # DeepSeek's n_shared_experts, fused
    if base == "exp_probs_b":
        return [(f"{prefix}{hf}", w)]  # a bias vector named without a `.bias` suffix in transformers
    if arch == "llama" and kind == "weight" and base in ("attn_q", "attn_k"):
        w = _unpermute(w, n_heads if base == "attn_q" else n_kv)
    if base == "ffn_gate_inp_shexp" and w.ndim == 1:
        w = w[None, :]  # llama.cpp stores the shared-expert gate as a vector
    if math.prod(w.shape) == 0:
        raise ModelLoadError(f"{source}: tensor {name!r} is empty")
    return [(f"{prefix}{hf}.{kind}", w)]
