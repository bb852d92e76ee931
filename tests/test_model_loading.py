"""Model loading: clear errors for what cannot be loaded; GGUF conversion round-trips."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from engine_helpers import drain, make_engine

from common.errors import ModelLoadError
from common.sampling_params import SamplingParams
from engine.loading.model_store import resolve_model
from engine.model.model_config import ModelConfig


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


GGUF_CASES = {
    # Llama 3.1-style RoPE scaling travels as llama.cpp's rope_freqs tensor.
    "llama3": dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                                    "rope_theta": 500000.0}),
    "mixtral": {}, "qwen2": {}, "qwen3": {}, "qwen3_moe": {}, "qwen2_moe": {},
    # MLA split into attn_k_b / attn_v_b, grouped sigmoid routing, YaRN as yarn_log_multiplier (llama.cpp
    # keeps only mscale_all_dim: cos/sin unscaled, i.e. mscale == mscale_all_dim as in every DeepSeek-V3).
    "deepseek_v3": dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                                         "mscale": 0.8, "mscale_all_dim": 0.8, "rope_theta": 10000.0}),
    "deepseek_v2": {},  # softmax gating (llama.cpp's default for deepseek2), group-limited top-k, no q LoRA
}


@pytest.mark.parametrize("name", sorted(GGUF_CASES))
def test_gguf_converts_and_equals_transformers(name, tmp_path, monkeypatch):
    """A GGUF written as llama.cpp writes it (permuted Q/K for llama, stacked experts, gpt2 tokenizer)
    converts to a directory that means the same model: same config, same greedy tokens."""
    pytest.importorskip("gguf")
    from gguf_writer import write_gguf
    from tokenizers import Tokenizer as HFTok

    monkeypatch.setenv("SPLITFIRE_HOME", str(tmp_path / "home"))
    hf = _hf(name, tmp_path / "hf", **GGUF_CASES[name])
    path = tmp_path / f"{name}.gguf"
    write_gguf(hf.path, path)
    model_dir = resolve_model(str(path))
    assert resolve_model(str(path)) == model_dir  # converted once, then reused
    ours, theirs = ModelConfig.from_dir(model_dir), ModelConfig.from_dir(hf.path)
    assert (ours.architecture, ours.layers, ours.moe, ours.qkv_bias, ours.qk_norm) == (
        theirs.architecture, theirs.layers, theirs.moe, theirs.qkv_bias, theirs.qk_norm)
    engine = make_engine(model_dir)
    prompt = list(range(3, 70))
    engine.add_request("g", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert drain(engine)["g"].token_ids == hf.greedy(prompt, 8)
    text = "Hello world! 0123"
    assert engine.tokenizer.encode(text) == HFTok.from_file(str(hf.path / "tokenizer.json")).encode(text).ids


def test_quantized_moe_gguf_equals_transformers_on_its_dequantized_weights(tmp_path, monkeypatch):
    """A Q8_0 mixture-of-experts GGUF: attention, embedding and every expert stay int8 (the stacked
    experts split per expert); with keep_quantized=False the whole file becomes a valid
    transformers checkpoint, and the two compute the same greedy tokens."""
    pytest.importorskip("gguf")
    import torch
    import transformers
    from gguf_writer import write_gguf
    from hf_models import HFModel

    from engine.loading.gguf_convert import convert_gguf

    monkeypatch.setenv("SPLITFIRE_HOME", str(tmp_path / "home"))
    hf = _hf("qwen3_moe", tmp_path / "hf")
    path = tmp_path / "q8.gguf"
    write_gguf(hf.path, path, quantize="Q8_0")
    model_dir = resolve_model(str(path))
    assert (model_dir / "model.safetensors.index.json").is_file()
    floats = tmp_path / "f32"
    floats.mkdir()
    convert_gguf(path, floats, keep_quantized=False)
    theirs = HFModel("q8", floats, transformers.AutoModelForCausalLM.from_pretrained(floats, dtype=torch.float32).eval(), {})
    engine = make_engine(model_dir, cpu_activations="float")
    assert engine.model.layers[0].attn.qkv.quantized is not None
    experts = engine.model.layers[0].mlp.experts
    assert experts.quantized is not None and experts.gate_up is None
    assert {w.kind for w in experts.quantized[0] + experts.quantized[1]} == {"int8"}
    prompt = list(range(3, 50))
    engine.add_request("q", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert drain(engine)["q"].token_ids == theirs.greedy(prompt, 8)
    # Quantization changed the weights (this is not the float32 model in disguise).
    assert not torch.equal(theirs.model.model.layers[0].self_attn.q_proj.weight, hf.model.model.layers[0].self_attn.q_proj.weight)


def test_llama3_rope_freqs_are_recognised_or_refused():
    import numpy as np
    from gguf_writer import llama3_rope_factors

    from engine.loading.gguf_convert import llama3_rope_from_factors

    rope = {"rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    got = llama3_rope_from_factors(llama3_rope_factors(rope, 64), 500000.0, 64)
    assert got == {"rope_type": "llama3", **{k: v for k, v in rope.items() if k != "rope_theta"}}
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        llama3_rope_from_factors(np.linspace(1, 3, 32, dtype=np.float32), 500000.0, 64)


def _hf(name: str, path, **kw):
    from hf_models import make_hf_model

    return make_hf_model(name, path, **kw)


def _rewrite_weights(d, fn) -> None:
    from safetensors.torch import load_file, save_file

    w = load_file(str(d / "model.safetensors"))
    fn(w)
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})


def test_missing_expert_tensor_is_named(tmp_path):
    hf = _hf("qwen3_moe", tmp_path / "m")
    _rewrite_weights(hf.path, lambda w: w.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"m: missing tensor 'model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight'"):
        make_engine(hf.path)


def test_shape_mismatch_names_the_file_and_tensor(tmp_path):
    hf = _hf("mixtral", tmp_path / "m")
    cfg = json.loads((hf.path / "config.json").read_text())
    cfg["intermediate_size"] = 80
    (hf.path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: tensor 'model\.layers\.0\.block_sparse_moe\.experts\.0\.w1\.weight' has shape \(96, 64\), the config implies \(80, 64\)"):
        make_engine(hf.path)


def test_weights_the_config_does_not_declare_are_refused(tmp_path):
    import torch

    hf = _hf("llama3", tmp_path / "m")  # attention_bias is false: a bias in the file would be ignored
    _rewrite_weights(hf.path, lambda w: w.update({"model.layers.1.self_attn.o_proj.bias": torch.zeros(64)}))
    with pytest.raises(ModelLoadError, match=r"does not account for.*o_proj\.bias"):
        make_engine(hf.path)


def test_truncated_safetensors_is_refused(tmp_path):
    hf = _hf("qwen3", tmp_path / "m")
    f = hf.path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match="truncated"):
        make_engine(hf.path)


def test_sharded_checkpoint_with_index_equals_transformers(tmp_path):
    hf = _hf("qwen2_moe", tmp_path / "m")
    sharded = tmp_path / "sharded"
    hf.model.save_pretrained(sharded, max_shard_size="100KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf.path / f, sharded / f)
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 2
    engine = make_engine(sharded)
    prompt = list(range(3, 60))
    engine.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert drain(engine)["s"].token_ids == hf.greedy(prompt, 6)


def test_generation_config_eos_list_ends_generation(tmp_path):
    hf = _hf("qwen3", tmp_path / "m")
    prompt = list(range(3, 30))
    expected = hf.greedy(prompt, 6)
    stop_at = next(i for i, t in enumerate(expected) if t not in expected[:i] and t > 2)
    gen = json.loads((hf.path / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, expected[stop_at]]
    (hf.path / "generation_config.json").write_text(json.dumps(gen))
    engine = make_engine(hf.path)
    engine.add_request("e", prompt, SamplingParams(temperature=0, max_tokens=6))
    out = drain(engine)["e"]
    assert out.token_ids == expected[: stop_at + 1] and out.finish_reason == "stop"


def test_loading_peak_rss_is_about_the_model_size(tmp_path):
    """Tensors are read one at a time straight into their parameters: the process peaks near the
    model's size (measured 1.2-1.4x with oneDNN packing's one-weight transient), not the 2.35x that
    allocating on "meta", moving, and reading through temporaries cost before."""
    from engine_helpers import load_memory
    from tiny_model import make_tiny_llama

    d = make_tiny_llama(tmp_path / "big", layers=3, hidden=1024, heads=8, kv_heads=8, intermediate=4096, tie=False)
    size = (d / "model.safetensors").stat().st_size
    peak = load_memory(d, {"SPLITFIRE_WEIGHT_CACHE": "0"}).peak_added
    assert peak < 1.5 * size, f"loading a {size / 2**20:.0f} MiB model raised peak RSS by {peak / 2**20:.0f} MiB"


def test_multimodal_gemma3_checkpoint_serves_its_text_model(tmp_path):
    """gemma-3-*-it checkpoints are Gemma3ForConditionalGeneration: the nested text model is served
    (vision tensors are left unread, images are refused at the router), equal to transformers."""
    from hf_models import make_gemma3_multimodal

    hf = make_gemma3_multimodal(tmp_path / "mm")
    assert ModelConfig.from_dir(hf.path).checkpoint_prefix == "language_model."
    engine = make_engine(hf.path)
    prompt = list(range(3, 60))
    engine.add_request("m", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert drain(engine)["m"].token_ids == hf.greedy(prompt, 8)


def _write_fp8(src: Path, dst: Path, block: int) -> None:
    from hf_models import write_block_fp8

    write_block_fp8(src, dst, block)


@pytest.mark.parametrize("name", ["llama3", "deepseek_v3"])
def test_fp8_checkpoint_equals_transformers_dequantizing_it(name, tmp_path):
    """A block-wise FP8 checkpoint (DeepSeek-V3 / Kimi-K2 / Qwen3-FP8 format) computes what its files mean;
    the oracle is transformers loading the same files (it dequantizes them without an FP8 GPU)."""
    pytest.importorskip("accelerate")
    import torch
    import transformers

    hf = _hf(name, tmp_path / "hf")
    _write_fp8(hf.path, tmp_path / "fp8", block=8)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.float32).eval()
    engine = make_engine(tmp_path / "fp8")
    prompt = list(range(3, 60))
    with torch.no_grad():
        ids, expected = list(prompt), []
        for _ in range(8):
            expected.append(int(theirs(torch.tensor([ids])).logits[0, -1].argmax()))
            ids.append(expected[-1])
    engine.add_request("g", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert drain(engine)["g"].token_ids == expected
    # Not vacuous: the FP8 files compute measurably different logits from the float model they came from.
    with torch.no_grad():
        x = torch.tensor([prompt])
        assert (theirs(x).logits - hf.model(x).logits).abs().max() > 1e-3


def test_fp8_checkpoint_outside_what_is_implemented_is_refused(tiny_model_dir, tmp_path):
    import json

    d = _copy(tiny_model_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    for q, named in (({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
                      "activation_scheme"),
                     ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size")):
        (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": q}))
        with pytest.raises(ModelLoadError, match=named):
            ModelConfig.from_dir(d)
