"""The architecture facts the runtime needs, read from a Hugging Face `config.json`.

A field is either honoured, refused with an error naming it, or (when it cannot change the
math: `initializer_range`, `use_cache`, ...) ignored. A field absent from the file takes the
value `transformers`' own config class gives it, per family (`DEFAULTS`; a test holds the two
equal), so a hand-trimmed config means what it means to `transformers`. Fields this module
has never heard of are named in one warning at load.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from common.errors import ModelLoadError
from engine.model.rope import RopeSpec, read_rope

log = logging.getLogger("splitfire.engine")

# Architecture → family (the `model_type` of its text model).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Gemma3ForCausalLM": "gemma3_text",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
# Other model_type values a supported architecture ships under (same tensors, same math).
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}

# Multimodal checkpoints whose text model is served (images are refused at the router):
# architecture -> (key of the nested text config, the text model's architecture, tensor prefix).
TEXT_ONLY = {
    "Gemma3ForConditionalGeneration": ("text_config", "Gemma3ForCausalLM", "language_model."),
}
# Their tensors that belong to the image side and are not loaded.
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")

# transformers' config class defaults for every field read here (tests/test_model_config.py
# compares them with the classes themselves).
_COMMON = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu", "rope_theta": 10000.0,
           "head_dim": None, "num_key_value_heads": None}
_QWEN_SLIDING = {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28, "layer_types": None}
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_COMMON, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "max_position_embeddings": 2048, "attention_bias": False, "mlp_bias": False,
              "bos_token_id": 1, "eos_token_id": 2},
    "mistral": {**_COMMON, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "max_position_embeddings": 131072, "sliding_window": 4096, "bos_token_id": 1, "eos_token_id": 2},
    "qwen2": {**_COMMON, **_QWEN_SLIDING, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
              "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 32768,
              "bos_token_id": None, "eos_token_id": None},
    "qwen3": {**_COMMON, **_QWEN_SLIDING, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
              "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 32768,
              "attention_bias": False, "head_dim": 128, "bos_token_id": None, "eos_token_id": None},
    "qwen2_moe": {**_COMMON, **_QWEN_SLIDING, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
                  "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
                  "max_position_embeddings": 32768, "num_experts": 60, "num_experts_per_tok": 4,
                  "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "norm_topk_prob": False,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "qkv_bias": True,
                  "bos_token_id": None, "eos_token_id": None},
    "qwen3_moe": {**_COMMON, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                  "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4,
                  "max_position_embeddings": 32768, "attention_bias": False, "use_sliding_window": False,
                  "sliding_window": 4096, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                  "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
                  "bos_token_id": None, "eos_token_id": None},
    "mixtral": {**_COMMON, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "vocab_size": 32000, "hidden_size": 4096,
                "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 8, "max_position_embeddings": 131072, "sliding_window": None,
                "num_experts": 8, "num_experts_per_tok": 2, "bos_token_id": 1, "eos_token_id": 2},
    "gemma3_text": {**_COMMON, "tie_word_embeddings": True, "rope_theta": 1e6, "rope_local_base_freq": 10000.0,
                    "hidden_activation": "gelu_pytorch_tanh", "vocab_size": 262208, "hidden_size": 2304,
                    "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
                    "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131072,
                    "attention_bias": False, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                    "sliding_window_pattern": 6, "layer_types": None, "final_logit_softcapping": None,
                    "attn_logit_softcapping": None, "use_bidirectional_attention": False,
                    "bos_token_id": 2, "eos_token_id": 1},
    "deepseek_v3": {**_COMMON, "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
                    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
                    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
                    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
                    "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4,
                    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
                    "max_position_embeddings": 4096, "rope_interleave": True, "attention_bias": False,
                    "bos_token_id": 0, "eos_token_id": 1,
                    # Fields of DeepSeek's own config.json (its remote code), not of transformers' class:
                    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1},
    "deepseek_v2": {**_COMMON, "vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 11008,
                    "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 2048,
                    "bos_token_id": 1, "eos_token_id": 2, "first_k_dense_replace": 0, "kv_lora_rank": 512,
                    "q_lora_rank": 1536, "n_group": None, "n_routed_experts": 64, "n_shared_experts": 2,
                    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "routed_scaling_factor": 1.0, "topk_group": None,
                    "topk_method": "greedy", "norm_topk_prob": False, "v_head_dim": 128, "num_experts_per_tok": None,
                    "moe_intermediate_size": 1407, "mlp_bias": False, "attention_bias": False,
                    "scoring_func": "softmax", "moe_layer_freq": 1},
}

ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh"}
ATTENTION_KINDS = ("full_attention", "sliding_attention")

# Fields that never change a forward pass (training, generation defaults, bookkeeping).
_INERT = {
    "architectures", "model_type", "transformers_version", "torch_dtype", "quantization_config", "dtype", "initializer_range", "use_cache",
    "attention_dropout", "pad_token_id", "pretraining_tp", "router_aux_loss_coef", "output_router_logits",
    "router_jitter_noise", "_name_or_path", "auto_map", "bos_token", "eos_token", "tokenizer_class",
    "output_attentions", "output_hidden_states", "return_dict", "is_encoder_decoder", "chunk_size_feed_forward",
    "id2label", "label2id", "problem_type", "tf_legacy_loss", "use_return_dict", "_attn_implementation",
    "_attn_implementation_autoset", "max_length", "num_beams", "temperature", "top_p", "top_k", "do_sample",
    "_sliding_window_pattern", "hidden_dropout", "embd_pdrop", "resid_pdrop", "cache_implementation",
    # DeepSeek-V3: training-only losses, expert-parallel degree, a derived field, the multi-token-prediction
    # module (its layers are skipped on load: splitfire does not draft with it).
    "aux_loss_alpha", "seq_aux", "ep_size", "qk_head_dim", "num_nextn_predict_layers", "num_mtp_layers",
}


@dataclass(frozen=True)
class LayerConfig:
    attention: str  # full_attention | sliding_attention
    window: int | None  # keys a query sees, itself included (transformers: kv_idx > q_idx - window); None = all
    rope: RopeSpec
    moe: bool  # routed experts instead of the dense MLP


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool  # top-k weights rescaled to sum to 1
    shared_intermediate_size: int = 0  # an always-on expert beside the routed ones
    shared_gated: bool = True  # the shared expert's output scaled by sigmoid(gate(x)) (Qwen2-MoE) or not (DeepSeek)
    # DeepSeek-V3 routing: sigmoid scores, a learned bias that steers the choice (not the weights),
    # experts chosen only from the `topk_groups` best of `num_groups` groups, weights scaled after.
    scoring: str = "softmax"  # softmax | sigmoid
    grouped: bool = False  # DeepSeek routing (route_grouped): groups, scaling; sigmoid adds the correction bias
    num_groups: int = 1
    topk_groups: int = 1
    routed_scale: float = 1.0


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): K and V of every head are up-projected from one
    `kv_lora_rank` latent per token, beside a `qk_rope_head_dim` RoPE key shared by all heads."""

    q_lora_rank: int | None  # None: q projected straight from the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleaved: bool  # the checkpoint's RoPE dims are pairs (2i, 2i+1) already


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    layers: tuple[LayerConfig, ...]
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    gemma_norm: bool = False  # RMSNorm scales by (1 + w), computed in float32
    sandwich_norm: bool = False  # extra norms on the attention and MLP outputs (Gemma 3)
    activation: str = "silu"  # silu | gelu | gelu_tanh
    embed_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden))
    attn_scale: float = 0.0  # q·k multiplier; 0 = head_dim ** -0.5
    final_logit_softcap: float | None = None
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    checkpoint_prefix: str = ""  # where the text model's tensors live ("language_model." in multimodal ones)
    # Block-wise FP8 checkpoint: matmul weights are float8_e4m3fn with a `weight_scale_inv` per
    # (rows, cols) block, kept FP8 in memory (`quant.from_block_fp8`; `weights._Loader`).
    fp8_weight_block: tuple[int, int] | None = None

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def scale(self) -> float:
        return self.attn_scale or self.head_dim**-0.5

    @property
    def kv_entry(self) -> tuple[int, int, int]:
        """What the paged cache holds per token and layer: (planes, heads, dim). K and V of every KV
        head, or (MLA) one plane of latent + RoPE key."""
        if self.mla is not None:
            return 1, 1, self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        return 2, self.num_kv_heads, self.head_dim

    @property
    def windows(self) -> tuple[int, ...]:
        """The distinct sliding windows of the layers (attention metadata is built once per window)."""
        return tuple(sorted({layer.window for layer in self.layers if layer.window is not None}))

    @property
    def ropes(self) -> tuple[RopeSpec, ...]:
        return tuple(dict.fromkeys(layer.rope for layer in self.layers))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = cfg.get("architectures") or []
        multimodal = next((a for a in archs if a in TEXT_ONLY), None)
        if multimodal is not None:
            key, text_arch, prefix = TEXT_ONLY[multimodal]
            text = cfg.get(key)
            if not isinstance(text, dict):
                raise ModelLoadError(f"{source}: {multimodal} without a {key} object")
            inherited: dict[str, Any] = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if k in cfg and k not in text}
            log.info("serving the text model of %s (images are not supported) source=%s", multimodal, source)
            out = cls.from_dict({**inherited, **text, "architectures": [text_arch]}, f"{source}: {key}")
            return replace(out, checkpoint_prefix=prefix)
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"{source}: unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"splitfire runs {sorted(SUPPORTED_ARCHITECTURES)} and the text model of {sorted(TEXT_ONLY)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        model_type = cfg.get("model_type")
        if model_type is not None and MODEL_TYPE_ALIASES.get(model_type, model_type) != family:
            raise ModelLoadError(f"{source}: model_type {model_type!r} does not match architecture {arch} "
                                 f"(expected {family!r})")
        r = _Fields(cfg, DEFAULTS[family], source)
        cfg_out = _read(r, arch, family)
        unknown = sorted(set(cfg) - r.read - _INERT)
        if unknown:
            log.warning("config fields not read (they do not change %s's forward pass in transformers, or "
                        "splitfire does not know them): %s source=%s", arch, unknown, source)
        return cfg_out

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{model_dir}: no config.json (is this a Hugging Face model directory?)")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{path}: corrupt JSON: {e}") from e
        if not isinstance(cfg, dict):
            raise ModelLoadError(f"{path}: expected a JSON object")
        fp8_block = None
        if "quantization_config" in cfg:
            q = cfg["quantization_config"] or {}
            method = q.get("quant_method")
            if method == "fp8":
                fp8_block = _fp8_block(q, path)
            elif method != "splitfire":
                raise ModelLoadError(f"{path}: quantization_config ({method!r}) is not supported: splitfire reads "
                                     "unquantized safetensors, block-wise FP8 (quant_method 'fp8', as DeepSeek-V3, "
                                     "Kimi-K2 and Qwen3 *-FP8 ship), GGUF, or its own int8/int4 layout (quant_method "
                                     "'splitfire', see engine/model/quant.py); pass an unquantized checkpoint and "
                                     "--quantization int8|int4")
        return replace(cls.from_dict(cfg, source=str(path)), fp8_weight_block=fp8_block)


def _fp8_block(q: dict[str, Any], path: Path) -> tuple[int, int]:
    """The (rows, cols) block of a fine-grained FP8 checkpoint: e4m3 weights, dynamic activation scales
    (on an FP8 GPU activations are quantized per token per 128 columns for the w8a8 GEMM; elsewhere the
    weights widen exactly inside the matmul and activations stay in the model dtype)."""
    if q.get("fmt", "e4m3") != "e4m3":
        raise ModelLoadError(f"{path}: quantization_config.fmt={q.get('fmt')!r} is not supported (only e4m3)")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ModelLoadError(f"{path}: quantization_config.activation_scheme={q.get('activation_scheme')!r} is not "
                             "supported (only 'dynamic': static activation scales were calibrated for FP8 matmuls)")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelLoadError(f"{path}: quantization_config.weight_block_size must be [rows, cols], got {block!r} "
                             "(per-tensor FP8 scales are not supported)")
    return block[0], block[1]


class _Fields:
    """Reads config fields with the family's defaults, remembering which were read."""

    def __init__(self, cfg: dict[str, Any], defaults: dict[str, Any], source: str):
        self.cfg, self.defaults, self.source = cfg, defaults, source
        self.read: set[str] = set()

    def get(self, name: str) -> Any:
        self.read.add(name)
        value = self.cfg.get(name)
        return self.defaults.get(name) if value is None and name not in self.cfg else value

    def int(self, name: str, minimum: int = 1) -> int:
        value = self.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ModelLoadError(f"{self.source}: {name} must be an integer >= {minimum}, got {value!r}")
        return value

    def refuse_unless(self, name: str, allowed: Any, why: str) -> None:
        value = self.get(name)
        if value != allowed:
            raise ModelLoadError(f"{self.source}: {name}={value!r} is not supported ({why})")

    def fail(self, message: str) -> ModelLoadError:
        return ModelLoadError(f"{self.source}: {message}")


def _read(r: _Fields, arch: str, family: str) -> ModelConfig:
    hidden = r.int("hidden_size")
    num_heads = r.int("num_attention_heads")
    num_kv = r.get("num_key_value_heads") or num_heads
    head_dim = r.get("head_dim") or hidden // num_heads
    mla = _mla(r, family) if family in ("deepseek_v2", "deepseek_v3") else None
    if mla is not None:
        # K and V of all heads come from the latent (num_key_value_heads does not apply); RoPE runs over
        # the decoupled dims, so those are the "head_dim" of the rope caches (as transformers sets it).
        num_kv, head_dim = num_heads, mla.qk_rope_head_dim
    if num_heads % num_kv:
        raise r.fail(f"num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads ({num_kv})")
    num_layers = r.int("num_hidden_layers")
    max_pos = r.int("max_position_embeddings")
    act_key = "hidden_activation" if family == "gemma3_text" else "hidden_act"
    act = r.get(act_key)
    if act not in ACTIVATIONS:
        raise r.fail(f"{act_key}={act!r} is not supported (supported: {sorted(ACTIVATIONS)})")
    kinds = _layer_kinds(r, family, num_layers)
    ropes = _ropes(r, family, max_pos)
    window = r.get("sliding_window")
    if "sliding_attention" in kinds and (not isinstance(window, int) or window < 1):
        raise r.fail(f"sliding_window={window!r}: layers are sliding_attention but the window is not a positive integer")
    moe, moe_layers = _moe(r, family, num_layers)
    layers = tuple(
        LayerConfig(kind, window if kind == "sliding_attention" else None, ropes[kind], i in moe_layers)
        for i, kind in enumerate(kinds)
    )
    eos = r.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())

    extra: dict[str, Any] = {}
    if family in ("llama",):
        extra["qkv_bias"] = extra["o_bias"] = bool(r.get("attention_bias"))
        extra["mlp_bias"] = bool(r.get("mlp_bias"))
    elif family in ("qwen2",):
        extra["qkv_bias"] = True
    elif family == "qwen2_moe":
        extra["qkv_bias"] = bool(r.get("qkv_bias"))
    elif family in ("qwen3", "qwen3_moe", "gemma3_text"):
        extra["qkv_bias"] = extra["o_bias"] = bool(r.get("attention_bias"))
        extra["qk_norm"] = True
    if family == "gemma3_text":
        r.refuse_unless("attn_logit_softcapping", None, "attention logit soft-capping is not implemented")
        r.refuse_unless("use_bidirectional_attention", False, "only causal attention is implemented")
        cap = r.get("final_logit_softcapping")
        extra.update(gemma_norm=True, sandwich_norm=True, embed_scale=hidden**0.5,
                     attn_scale=float(r.get("query_pre_attn_scalar")) ** -0.5,
                     final_logit_softcap=float(cap) if cap is not None else None)
    if mla is not None:
        if r.get("attention_bias"):
            raise r.fail("attention_bias=True with multi-head latent attention is not implemented")
        extra.update(mla=mla, attn_scale=_mla_scale(r, mla))
    return ModelConfig(
        architecture=arch,
        vocab_size=r.int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=r.int("intermediate_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(num_kv),
        head_dim=int(head_dim),
        rms_norm_eps=float(r.get("rms_norm_eps")),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(r.get("tie_word_embeddings")),
        layers=layers,
        activation=ACTIVATIONS[act],
        moe=moe,
        bos_token_id=r.get("bos_token_id"),
        eos_token_ids=eos_ids,
        **extra,
    )


def _layer_kinds(r: _Fields, family: str, num_layers: int) -> list[str]:
    """Each layer's attention kind, by the rule the family's transformers config applies."""
    if family in ("llama",):
        return ["full_attention"] * num_layers
    if family in ("mistral", "mixtral"):
        sliding = r.get("sliding_window") is not None
        return ["sliding_attention" if sliding else "full_attention"] * num_layers
    if family == "qwen3_moe":
        sliding = bool(r.get("use_sliding_window")) and r.get("sliding_window") is not None
        return ["sliding_attention" if sliding else "full_attention"] * num_layers
    kinds = r.get("layer_types")
    r.read.add("max_window_layers")  # what it means is spelled out by layer_types when present
    if kinds is None:
        if family == "gemma3_text":
            pattern = r.int("sliding_window_pattern")
            kinds = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        else:
            use, window, first = r.get("use_sliding_window"), r.get("sliding_window"), r.get("max_window_layers")
            if family == "qwen2_moe":
                kinds = ["sliding_attention" if (i + 1) % 2 and i < first and use and window else "full_attention"
                         for i in range(num_layers)]
            else:
                kinds = ["sliding_attention" if use and window is not None and i >= first else "full_attention"
                         for i in range(num_layers)]
    elif family == "qwen2_moe" or family in ("qwen2", "qwen3"):
        if not r.get("use_sliding_window"):
            # transformers sets sliding_window to None without use_sliding_window: the layers see everything.
            kinds = ["full_attention"] * len(kinds)
    if len(kinds) != num_layers:
        raise r.fail(f"layer_types has {len(kinds)} entries for {num_layers} layers")
    bad = sorted({k for k in kinds if k not in ATTENTION_KINDS})
    if bad:
        raise r.fail(f"layer_types {bad} are not supported (supported: {list(ATTENTION_KINDS)})")
    return list(kinds)


def _ropes(r: _Fields, family: str, max_pos: int) -> dict[str, RopeSpec]:
    """RopeSpec per attention kind, from `rope_parameters` (flat or nested per kind) or the legacy
    `rope_theta` + `rope_scaling` (which, as in transformers, wins over a flat `rope_parameters`)."""
    params, legacy, partial = r.get("rope_parameters"), r.get("rope_scaling"), r.get("partial_rotary_factor")
    for name, value in (("rope_parameters", params), ("rope_scaling", legacy)):
        if value is not None and not isinstance(value, dict):
            raise r.fail(f"{name} must be an object, got {value!r}")
    nested = params is not None and any(k in params for k in ATTENTION_KINDS)
    gemma = family == "gemma3_text"
    out: dict[str, RopeSpec] = {}
    for kind in ATTENTION_KINDS:
        local = gemma and kind == "sliding_attention"
        theta = r.get("rope_local_base_freq") if local else r.get("rope_theta")
        if nested:
            p, where = dict(params.get(kind) or {}), f"rope_parameters.{kind}"
            if gemma and not local and legacy:
                p.update(legacy)
        elif local:
            p, where = {}, "rope_local_base_freq"  # Gemma 3's legacy layout: rope_scaling is for global layers
        else:
            p = dict(legacy or params or {})
            where = "rope_scaling" if legacy else "rope_parameters"
        p.setdefault("rope_theta", theta)
        if partial is not None:
            p.setdefault("partial_rotary_factor", partial)
        out[kind] = read_rope(p, max_pos, r.source, where)
    return out


def _mla(r: _Fields, family: str) -> MLAConfig:
    q_rank = r.get("q_lora_rank")
    if q_rank is not None and (not isinstance(q_rank, int) or q_rank < 1):
        raise r.fail(f"q_lora_rank must be a positive integer or null, got {q_rank!r}")
    rope_dim = r.int("qk_rope_head_dim")
    if rope_dim % 2:
        raise r.fail(f"qk_rope_head_dim={rope_dim} must be even (RoPE rotates pairs)")
    return MLAConfig(q_lora_rank=q_rank, kv_lora_rank=r.int("kv_lora_rank"), qk_nope_head_dim=r.int("qk_nope_head_dim"),
                     qk_rope_head_dim=rope_dim, v_head_dim=r.int("v_head_dim"),
                     # DeepSeek-V2 rotates interleaved pairs (a complex multiply in transformers), always.
                     rope_interleaved=family == "deepseek_v2" or bool(r.get("rope_interleave")))


def _mla_scale(r: _Fields, mla: MLAConfig) -> float:
    """Softmax scale: 1/sqrt(nope + rope dims), times YaRN's mscale(factor, mscale_all_dim) squared when the
    rope is scaled (transformers' `yarn_apply_mscale`; the cos/sin carry the rest of the attention factor)."""
    scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
    rope = r.cfg.get("rope_scaling") or r.cfg.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default" and rope.get("mscale_all_dim"):
        factor = float(rope.get("factor") or 1.0)
        m = 1.0 if factor <= 1 else 0.1 * float(rope["mscale_all_dim"]) * math.log(factor) + 1.0
        scale *= m * m
    return scale


def _moe(r: _Fields, family: str, num_layers: int) -> tuple[MoEConfig | None, set[int]]:
    if family in ("deepseek_v2", "deepseek_v3"):
        return _deepseek_moe(r, family, num_layers)
    if family not in ("qwen2_moe", "qwen3_moe", "mixtral"):
        return None, set()
    num_experts = r.get("num_local_experts") if "num_local_experts" in r.cfg else r.get("num_experts")
    r.read.update(("num_experts", "num_local_experts"))
    if not isinstance(num_experts, int) or num_experts < 1:
        raise r.fail(f"num_experts must be a positive integer, got {num_experts!r}")
    top_k = r.int("num_experts_per_tok")
    if top_k > num_experts:
        raise r.fail(f"num_experts_per_tok ({top_k}) exceeds the number of experts ({num_experts})")
    if family == "mixtral":
        return MoEConfig(num_experts, top_k, r.int("intermediate_size"), renormalize=True), set(range(num_layers))
    step = r.int("decoder_sparse_step")
    dense_only = set(r.get("mlp_only_layers") or [])
    layers = {i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0}
    shared = r.int("shared_expert_intermediate_size", minimum=0) if family == "qwen2_moe" else 0
    return MoEConfig(num_experts, top_k, r.int("moe_intermediate_size"), renormalize=bool(r.get("norm_topk_prob")),
                     shared_intermediate_size=shared), layers


def _deepseek_moe(r: _Fields, family: str, num_layers: int) -> tuple[MoEConfig, set[int]]:
    """Routed + shared experts after `first_k_dense_replace` dense layers. DeepSeek-V3: grouped sigmoid
    routing ("noaux_tc": the correction bias picks experts, the unbiased scores weight them).
    DeepSeek-V2: softmax scores, plain top-k ("greedy") or within the best groups by their best
    expert ("group_limited_greedy"), unnormalised, scaled."""
    v3 = family == "deepseek_v3"
    if v3:
        r.refuse_unless("scoring_func", "sigmoid", "DeepSeek-V3 routing scores with a sigmoid")
        r.refuse_unless("topk_method", "noaux_tc", "DeepSeek-V3's bias-corrected group-limited top-k is what is "
                        "implemented")
    else:
        r.refuse_unless("scoring_func", "softmax", "DeepSeek-V2 routing scores with a softmax")
        if r.get("topk_method") not in ("greedy", "group_limited_greedy"):
            raise r.fail(f"topk_method={r.get('topk_method')!r} is not supported for DeepSeek-V2 "
                         "(supported: greedy, group_limited_greedy)")
        # transformers' DeepSeek-V2 router never renormalises; DeepSeek's own code would: refuse the ambiguity.
        r.refuse_unless("norm_topk_prob", False, "transformers' DeepSeek-V2 does not renormalise top-k weights")
        r.refuse_unless("mlp_bias", False, "MLP biases are not implemented for DeepSeek-V2")
    r.read.add("num_local_experts")
    experts, top_k = r.int("n_routed_experts"), r.int("num_experts_per_tok")
    grouped = v3 or r.get("topk_method") == "group_limited_greedy"
    groups, topk_groups = (r.get("n_group") or 1, r.get("topk_group") or 1) if grouped else (1, 1)
    if top_k > experts:
        raise r.fail(f"num_experts_per_tok ({top_k}) exceeds n_routed_experts ({experts})")
    if experts % groups or topk_groups > groups:
        raise r.fail(f"n_group={groups}, topk_group={topk_groups} do not divide {experts} routed experts")
    if v3 and groups > 1 and experts // groups < 2:
        raise r.fail(f"n_group={groups} leaves fewer than 2 experts per group (a group scores by its best two)")
    first, freq = r.int("first_k_dense_replace", minimum=0), r.int("moe_layer_freq")
    shared = r.int("n_shared_experts", minimum=0) * r.int("moe_intermediate_size")
    moe = MoEConfig(experts, top_k, r.int("moe_intermediate_size"), renormalize=bool(r.get("norm_topk_prob")),
                    shared_intermediate_size=shared, shared_gated=False, scoring="sigmoid" if v3 else "softmax",
                    num_groups=groups, topk_groups=topk_groups, routed_scale=float(r.get("routed_scaling_factor")),
                    grouped=True)
    return moe, {i for i in range(num_layers) if i >= first and i % freq == 0}
