"""Model loading: clear errors for what cannot be loaded; GGUF conversion round-trips."""

from __future__ import annotations

import json
import shutil

import pytest
from engine_helpers import drain, make_engine

from engine.errors import ModelLoadError
from engine.model_config import ModelConfig
from engine.model_store import resolve_model
from engine.sampling_params import SamplingParams


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture_is_named(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="MambaForCausalLM"):
        make_engine(d)


def test_missing_tensor_is_named(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    d = _copy(tiny_model_dir, tmp_path / "m")
    w = load_file(str(d / "model.safetensors"))
    del w["model.layers.1.mlp.down_proj.weight"]
    save_file(w, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        make_engine(d)


def test_corrupt_weights_and_config(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path / "m")
    (d / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="safetensors"):
        make_engine(d)
    (d / "config.json").write_text("{broken")
    with pytest.raises(ModelLoadError, match="corrupt JSON"):
        ModelConfig.from_dir(d)


def test_unknown_model_name_lists_choices():
    with pytest.raises(ModelLoadError, match="smollm2-135m-instruct"):
        resolve_model("no-such-model")


def test_llama3_rope_scaling_is_read(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    (d / "config.json").write_text(json.dumps(cfg))
    engine = make_engine(d)
    engine.add_request("r", list(range(3, 20)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(drain(engine)["r"].token_ids) == 4


def test_gguf_file_converts_and_runs(tiny_model_dir, tmp_path, monkeypatch):
    """Write the tiny model as a GGUF (llama.cpp layout: permuted Q/K, gpt2 tokenizer) and load it."""
    gguf = pytest.importorskip("gguf")
    import numpy as np
    from reference import ReferenceLlama
    from safetensors.torch import load_file
    from tokenizers import Tokenizer as HFTok

    from engine.gguf_convert import _unpermute

    monkeypatch.setenv("SPLITFIRE_HOME", str(tmp_path / "home"))
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    w = load_file(str(tiny_model_dir / "model.safetensors"))
    path = tmp_path / "tiny.gguf"
    wr = gguf.GGUFWriter(str(path), "llama")
    wr.add_block_count(cfg["num_hidden_layers"])
    wr.add_context_length(cfg["max_position_embeddings"])
    wr.add_embedding_length(cfg["hidden_size"])
    wr.add_feed_forward_length(cfg["intermediate_size"])
    wr.add_head_count(cfg["num_attention_heads"])
    wr.add_head_count_kv(cfg["num_key_value_heads"])
    wr.add_rope_freq_base(cfg["rope_theta"])
    wr.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    tj = json.loads((tiny_model_dir / "tokenizer.json").read_text())
    vocab = HFTok.from_file(str(tiny_model_dir / "tokenizer.json")).get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tj["added_tokens"]}
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre("gpt-2")
    wr.add_token_list(tokens)
    wr.add_token_types([3 if t in special else 1 for t in tokens])
    merges = tj["model"]["merges"]
    wr.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    wr.add_bos_token_id(1)
    wr.add_eos_token_id(2)
    wr.add_chat_template(json.loads((tiny_model_dir / "tokenizer_config.json").read_text())["chat_template"])

    def permute(x, n):  # llama.cpp's convert_hf_to_gguf permutation (inverse of _unpermute)
        return x.reshape(n, 2, x.shape[0] // n // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    wr.add_tensor("token_embd.weight", w["model.embed_tokens.weight"].numpy())
    wr.add_tensor("output_norm.weight", w["model.norm.weight"].numpy())
    for i in range(cfg["num_hidden_layers"]):
        for hf, gg in names.items():
            x = w[f"model.layers.{i}.{hf}.weight"].numpy()
            if gg == "attn_q":
                x = permute(x, cfg["num_attention_heads"])
            elif gg == "attn_k":
                x = permute(x, cfg["num_key_value_heads"])
            assert np.array_equal(_unpermute(x, cfg["num_attention_heads"] if gg == "attn_q" else cfg["num_key_value_heads"]),
                                  w[f"model.layers.{i}.{hf}.weight"].numpy()) or gg not in ("attn_q", "attn_k")
            wr.add_tensor(f"blk.{i}.{gg}.weight", x)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()

    model_dir = resolve_model(str(path))
    assert resolve_model(str(path)) == model_dir  # converted once, then reused
    engine = make_engine(model_dir)
    prompt = list(range(3, 30))
    engine.add_request("g", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert drain(engine)["g"].token_ids == ReferenceLlama(tiny_model_dir).greedy(prompt, 8)
    text = "Hello world! 0123"
    assert engine.tokenizer.encode(text) == HFTok.from_file(str(tiny_model_dir / "tokenizer.json")).encode(text).ids
