"""Reading config.json cannot silently be wrong: defaults, both layouts and every rope variant
mean what they mean to transformers, and what splitfire does not implement is refused by name."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from common.errors import ModelLoadError
from engine.model.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from engine.model.rope import read_rope

CONFIG_CLASSES = {
    "LlamaForCausalLM": "LlamaConfig", "MistralForCausalLM": "MistralConfig", "Qwen2ForCausalLM": "Qwen2Config",
    "Qwen3ForCausalLM": "Qwen3Config", "Qwen2MoeForCausalLM": "Qwen2MoeConfig",
    "Qwen3MoeForCausalLM": "Qwen3MoeConfig", "MixtralForCausalLM": "MixtralConfig",
    "Gemma3ForCausalLM": "Gemma3TextConfig", "DeepseekV3ForCausalLM": "DeepseekV3Config",
    "DeepseekV2ForCausalLM": "DeepseekV2Config",
}
# Where transformers' own defaults are not a runnable model (DeepSeek-V2 leaves top-k unset).
BARE = {"DeepseekV2ForCausalLM": {"num_experts_per_tok": 6}}


def _theirs_rope_theta(c, kind: str) -> float:
    params = c.rope_parameters
    return (params[kind] if kind in params else params)["rope_theta"]


def _theirs_kinds(c) -> list[str]:
    kinds = getattr(c, "layer_types", None)
    if kinds is not None:
        if getattr(c, "use_sliding_window", True) is False:  # the qwen rule: no window unless asked for
            return ["full_attention"] * c.num_hidden_layers
        return list(kinds)
    sliding = getattr(c, "sliding_window", None) is not None
    return ["sliding_attention" if sliding else "full_attention"] * c.num_hidden_layers


def _compare(ours: ModelConfig, c) -> None:
    heads = c.num_attention_heads
    assert (ours.vocab_size, ours.hidden_size, ours.intermediate_size, ours.num_layers, ours.num_heads) == (
        c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers, heads)
    assert ours.num_kv_heads == (c.num_key_value_heads or heads)
    assert ours.head_dim == (getattr(c, "head_dim", None) or c.hidden_size // heads)
    assert ours.rms_norm_eps == c.rms_norm_eps
    assert ours.max_position_embeddings == c.max_position_embeddings
    assert ours.tie_word_embeddings == c.tie_word_embeddings
    assert [layer.attention for layer in ours.layers] == _theirs_kinds(c)
    for layer in ours.layers:
        assert layer.rope.theta == _theirs_rope_theta(c, layer.attention)
        if layer.window is not None:
            assert layer.window == c.sliding_window
    if ours.moe is not None:
        assert ours.moe.num_experts == getattr(c, "num_local_experts", getattr(c, "num_experts", None))
        assert ours.moe.top_k == c.num_experts_per_tok


@pytest.mark.parametrize("arch", sorted(SUPPORTED_ARCHITECTURES))
def test_a_bare_config_means_what_it_means_to_transformers(arch):
    """Fields absent from config.json take transformers' class defaults, family by family."""
    extra = BARE.get(arch, {})
    ours = ModelConfig.from_dict({"architectures": [arch], **extra})
    _compare(ours, getattr(transformers, CONFIG_CLASSES[arch])(**extra))


@pytest.mark.parametrize("arch, fields", [
    ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=64, max_window_layers=2, num_hidden_layers=5)),
    ("Qwen2ForCausalLM", dict(use_sliding_window=False, sliding_window=131072)),  # Qwen2.5's shipped configs
    ("Qwen3MoeForCausalLM", dict(use_sliding_window=True, sliding_window=100)),
    ("MistralForCausalLM", dict(sliding_window=None)),
    ("Gemma3ForCausalLM", dict(sliding_window_pattern=2, num_hidden_layers=5, sliding_window=33)),
    ("Gemma3ForCausalLM", dict(rope_theta=500000.0, rope_local_base_freq=5000.0,
                               rope_scaling={"rope_type": "linear", "factor": 8.0})),
    ("LlamaForCausalLM", dict(rope_theta=500000.0, num_key_value_heads=8, head_dim=64)),
])
def test_window_and_rope_rules_match_transformers(arch, fields):
    ours = ModelConfig.from_dict({"architectures": [arch], **fields})
    _compare(ours, getattr(transformers, CONFIG_CLASSES[arch])(**fields))


def test_gemma3_legacy_layout_equals_nested_layout():
    legacy = ModelConfig.from_dict({"architectures": ["Gemma3ForCausalLM"], "rope_theta": 1e6,
                                    "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    nested = ModelConfig.from_dict({"architectures": ["Gemma3ForCausalLM"], "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    assert legacy.layers == nested.layers
    assert {layer.rope.kind for layer in legacy.layers} == {"linear", "default"}


@pytest.mark.parametrize("params", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192, "rope_theta": 500000.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1000000.0},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
     "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048, "rope_theta": 10000.0,
     "attention_factor": 1.3, "truncate": False},
])
def test_rope_frequencies_equal_transformers(params):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    c = transformers.Qwen3Config(head_dim=128, max_position_embeddings=131072, rope_parameters=dict(params))
    kind = params["rope_type"]
    if kind == "default":
        theirs, scale = transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding.compute_default_rope_parameters(c)
    else:
        theirs, scale = ROPE_INIT_FUNCTIONS[kind](c, None)
    spec = read_rope(dict(params), 131072, "config.json", "rope_parameters")
    torch.testing.assert_close(spec.inv_freq(128), theirs.float(), rtol=1e-6, atol=0)
    assert math.isclose(spec.attention_factor, scale, rel_tol=1e-9)


@pytest.mark.parametrize("fields, named", [
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope_type 'dynamic'"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}}, "rope_scaling has fields"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [16, 24, 24]}}, "mrope_section"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}}, "low_freq_factor"),
    ({"hidden_act": "relu2"}, "hidden_act='relu2'"),
    ({"model_type": "qwen2"}, "model_type 'qwen2'"),
])
def test_what_is_not_implemented_is_refused_by_name(fields, named):
    with pytest.raises(ModelLoadError, match=named.replace("[", r"\[").replace("(", r"\(")):
        ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], **fields}, source="x/config.json")


@pytest.mark.parametrize("arch, fields, named", [
    ("Gemma3ForCausalLM", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("Gemma3ForCausalLM", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("Gemma3ForCausalLM", {"hidden_activation": "swiglu"}, "hidden_activation"),
    ("Qwen3ForCausalLM", {"layer_types": ["full_attention", "chunked_attention"], "num_hidden_layers": 2,
                          "use_sliding_window": True}, "chunked_attention"),
    ("Qwen3ForCausalLM", {"layer_types": ["full_attention"], "num_hidden_layers": 2}, "layer_types has 1"),
    ("MixtralForCausalLM", {"num_local_experts": 2, "num_experts_per_tok": 3}, "num_experts_per_tok"),
    ("MistralForCausalLM", {"sliding_window": 0}, "sliding_window"),
])
def test_family_fields_outside_what_is_implemented_are_refused(arch, fields, named):
    with pytest.raises(ModelLoadError, match=named):
        ModelConfig.from_dict({"architectures": [arch], **fields})


def test_quantized_checkpoint_is_refused(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                      "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(ModelLoadError, match="quantization_config"):
        ModelConfig.from_dir(tmp_path)


def test_unknown_fields_are_named_in_a_warning(caplog):
    with caplog.at_level("WARNING"):
        ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "use_cache": True, "fancy_new_knob": 3})
    assert "fancy_new_knob" in caplog.text and "use_cache" not in caplog.text
