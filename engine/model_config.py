"""The architecture facts the runtime needs, read from a Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError

# Architectures that share the Llama block layout (pre-norm, RoPE, GQA, SwiGLU MLP).
# Qwen2 adds a bias on the q/k/v projections; everything else is identical.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}


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
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"{source}: unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"splitfire runs {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            num_heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            rope_scaling = cfg.get("rope_scaling")
            if rope_scaling is not None:
                kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
                if kind not in ("llama3", "linear", "default"):
                    raise ModelLoadError(f"{source}: unsupported rope_scaling type {kind!r}")
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
                head_dim=int(cfg.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(cfg.get("rope_theta", 10000.0)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
                rope_scaling=rope_scaling,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except KeyError as e:
            raise ModelLoadError(f"{source}: missing required field {e.args[0]!r}") from e

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{model_dir}: no config.json (is this a Hugging Face model directory?)")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{path}: corrupt JSON: {e}") from e
        return cls.from_dict(cfg, source=str(path))
