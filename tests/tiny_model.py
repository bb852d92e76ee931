"""A tiny random Llama, made on the spot: a real HF model directory (config, safetensors,
byte-level BPE tokenizer trained on a small corpus, ChatML template), small enough
that a test runs it in milliseconds."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Disaggregated serving splits prefill and decode across workers.",
    "Hello world! Héllo wörld — naïve café, 日本語のテキスト, emoji 🚀🔥.",
    "def main():\n    print('hello')\n    return 42\n",
    "Numbers 0123456789 and symbols #$%&*()[]{}<>?/\\|",
] * 20


def make_tokenizer(out: Path, extra_special: tuple[str, ...] = ()) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", *extra_special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "chat_template": CHATML,
        "add_bos_token": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tok.get_vocab_size()


def make_tiny_llama(
    out: Path,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    max_positions: int = 1024,
    tie: bool = True,
    architecture: str = "LlamaForCausalLM",
    seed: int = 0,
    extra_special: tuple[str, ...] = (),
) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(out, extra_special)
    head_dim = hidden // heads
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 0.15) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rnd(vocab, hidden, scale=0.3)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + rnd(hidden, scale=0.1)
        t[p + "post_attention_layernorm.weight"] = 1 + rnd(hidden, scale=0.1)
        t[p + "self_attn.q_proj.weight"] = rnd(heads * head_dim, hidden)
        t[p + "self_attn.k_proj.weight"] = rnd(kv_heads * head_dim, hidden)
        t[p + "self_attn.v_proj.weight"] = rnd(kv_heads * head_dim, hidden)
        t[p + "self_attn.o_proj.weight"] = rnd(hidden, heads * head_dim)
        t[p + "mlp.gate_proj.weight"] = rnd(intermediate, hidden)
        t[p + "mlp.up_proj.weight"] = rnd(intermediate, hidden)
        t[p + "mlp.down_proj.weight"] = rnd(hidden, intermediate)
        if architecture == "Qwen2ForCausalLM":
            for n, d in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                t[p + f"self_attn.{n}_proj.bias"] = rnd(d * head_dim, scale=0.1)
    t["model.norm.weight"] = 1 + rnd(hidden, scale=0.1)
    if not tie:
        t["lm_head.weight"] = rnd(vocab, hidden)
    save_file({k: v.contiguous() for k, v in t.items()}, str(out / "model.safetensors"))
    config = {
        "architectures": [architecture],
        "model_type": "qwen2" if architecture == "Qwen2ForCausalLM" else "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": tie,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return out
