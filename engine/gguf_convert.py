"""Converting a GGUF file into a Hugging Face model directory, once.

GGUF tensors are dequantized (numpy, via the `gguf` package) to float32, so the
converted model computes exactly what the quantized weights mean. llama.cpp stores
Q and K rows permuted for its interleaved RoPE; they are permuted back to the
Hugging Face half-split layout that `model.py` uses.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from engine.errors import ModelLoadError

_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: interleaved rotary pairs back to two halves."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def _build_tokenizer(reader: Any, out_dir: Path) -> dict[str, Any]:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

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
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if _field(reader, "tokenizer.ggml.pre") in ("smollm", "starcoder", "refact", "qwen2"):
        # These split every digit on its own before the GPT-2 regex (llama.cpp does the same).
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
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
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_field(reader, "llama.context_length", 2048)),
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


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json, model.safetensors and the tokenizer files for `gguf_path` into `out_dir`."""
    import gguf
    from safetensors.numpy import save_file

    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except Exception as e:
        raise ModelLoadError(f"{gguf_path}: not a readable GGUF file: {e}") from e
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"{gguf_path}: unsupported GGUF architecture {arch!r} (supported: 'llama')")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ModelLoadError(f"{gguf_path}: Llama 3.1 rope_freqs in GGUF is not supported; use the HF directory")
    n_heads = int(_field(reader, "llama.attention.head_count"))
    n_kv = int(_field(reader, "llama.attention.head_count_kv", n_heads))
    tok_info = _build_tokenizer(reader, out_dir)
    hidden = int(_field(reader, "llama.embedding_length"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": tok_info["vocab"],
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": int(_field(reader, "llama.rope.dimension_count", hidden // n_heads)),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, "llama.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "bos_token_id": tok_info["bos_token_id"],
        "eos_token_id": tok_info["eos_token_id"],
    }
    tensors: dict[str, np.ndarray] = {}
    for t in tqdm(reader.tensors, desc=f"dequantizing {gguf_path.name}", unit="tensor"):
        hf = _hf_name(t.name)
        if hf is None:
            raise ModelLoadError(f"{gguf_path}: unexpected tensor {t.name!r}")
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        if hf.endswith("q_proj.weight"):
            w = _unpermute(w, n_heads)
        elif hf.endswith("k_proj.weight"):
            w = _unpermute(w, n_kv)
        tensors[hf] = np.ascontiguousarray(w)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt", "source": gguf_path.name})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
