"""Loading a Hugging Face model directory's safetensors into `LlamaModel`.

q/k/v and gate/up are concatenated on load so each runs as one matmul.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine.errors import ModelLoadError
from engine.model import LlamaModel, interleave_rope_rows
from engine.model_config import ModelConfig


def _shard_index(model_dir: Path) -> dict[str, Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: corrupt shard index: {e}") from e
        return {name: model_dir / shard for name, shard in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weights")
    out: dict[str, Path] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                out.update(dict.fromkeys(st.keys(), f))
        except SafetensorError as e:
            raise ModelLoadError(f"{f}: corrupt safetensors file: {e}") from e
    return out


class _TensorSource:
    def __init__(self, model_dir: Path, stack: ExitStack):
        self.where = _shard_index(model_dir)
        self.stack = stack
        self.handles: dict[Path, object] = {}
        self.model_dir = model_dir

    def has(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> torch.Tensor:
        path = self.where.get(name)
        if path is None:
            raise ModelLoadError(f"{self.model_dir}: missing tensor {name!r}")
        if path not in self.handles:
            if not path.is_file():
                raise ModelLoadError(f"{self.model_dir}: shard {path.name} listed in the index is missing")
            try:
                self.handles[path] = self.stack.enter_context(safe_open(str(path), framework="pt"))
            except SafetensorError as e:
                raise ModelLoadError(f"{path}: corrupt safetensors file: {e}") from e
        try:
            return self.handles[path].get_tensor(name)  # type: ignore[attr-defined]
        except SafetensorError as e:
            raise ModelLoadError(f"{path}: cannot read tensor {name!r}: {e}") from e


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ModelLoadError(f"tensor {name!r} has shape {tuple(src.shape)}, config implies {tuple(dst.shape)}")
    dst.copy_(src)


def load_model(model_dir: str | Path, device: torch.device, dtype: torch.dtype) -> LlamaModel:
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = LlamaModel(cfg)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    with ExitStack() as stack, torch.no_grad():
        src = _TensorSource(model_dir, stack)
        _copy(model.embed.weight, src.get("model.embed_tokens.weight"), "model.embed_tokens.weight")
        _copy(model.norm.weight, src.get("model.norm.weight"), "model.norm.weight")
        if not cfg.tie_word_embeddings:
            name = "lm_head.weight" if src.has("lm_head.weight") else "model.embed_tokens.weight"
            _copy(model.lm_head.weight, src.get(name), name)
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}."
            _copy(layer.attn_norm.weight, src.get(p + "input_layernorm.weight"), p + "input_layernorm.weight")
            _copy(layer.mlp_norm.weight, src.get(p + "post_attention_layernorm.weight"), p + "post_attention_layernorm.weight")
            for part in ("weight", "bias") if cfg.attention_bias else ("weight",):
                q, k, v = (src.get(f"{p}self_attn.{n}_proj.{part}") for n in "qkv")
                fused = torch.cat((interleave_rope_rows(q, cfg.num_heads), interleave_rope_rows(k, cfg.num_kv_heads), v))
                _copy(getattr(layer.attn.qkv, part), fused, f"{p}self_attn.qkv.{part}")
            _copy(layer.attn.o.weight, src.get(p + "self_attn.o_proj.weight"), p + "self_attn.o_proj.weight")
            gate_up = [src.get(f"{p}mlp.{n}_proj.weight") for n in ("gate", "up")]
            _copy(layer.mlp.gate_up.weight, torch.cat(gate_up), p + "mlp.gate_up")
            _copy(layer.mlp.down.weight, src.get(p + "mlp.down_proj.weight"), p + "mlp.down_proj.weight")
    model.eval()
    if device.type == "cpu":
        model.optimize_for_cpu()
    return model
