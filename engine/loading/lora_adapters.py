"""LoRA adapters in the Hugging Face PEFT layout, read and checked against the served model.

A directory holds `adapter_config.json` (rank `r`, `lora_alpha`, `use_rslora`, `target_modules`, ...)
and `adapter_model.safetensors` with `...layers.{i}.self_attn.{q,k,v,o}_proj.lora_{A,B}.weight` and
`...layers.{i}.mlp.{gate,up,down}_proj.lora_{A,B}.weight` (A `[r, in]`, B `[out, r]`). Each adapter
becomes, per projection of the model, one A and one B ready for `LoRAWeights.set`: the scale
(`alpha / r`, or `alpha / sqrt(r)` with rsLoRA) folded into B; q and k's B rows put in the order this
model keeps q and k in (interleaved RoPE pairs, `decoder.interleave_rope_rows`); fused projections'
parts side by side (`engine/model/lora.py`).

Everything that cannot be served exactly is refused by name (`LoRAError`, a 400 at the edge): a
missing or unreadable file, a rank above `--max-lora-rank`, DoRA, per-module rank or alpha patterns,
trained biases, extra saved modules, a target this model lacks or that splitfire does not adapt
(experts, latent attention, embeddings, the LM head), and factors whose shapes do not fit (an adapter
made for another base model).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.errors import RequestError
from engine.model.decoder import Attention, DecoderModel, interleave_rope_rows
from engine.model.layers import MLP

_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.lora_(A|B)(?:\.default)?\.weight$")
# A projection's place: (the fused linear's name, the part's index among its parts)
_PLACE = {"q": ("qkv", 0), "k": ("qkv", 1), "v": ("qkv", 2), "o": ("o", 0), "gate": ("gate_up", 0),
          "up": ("gate_up", 1), "down": ("down", 0)}


class LoRAError(RequestError):
    """An adapter that cannot be served as it is (the message names the adapter and the problem)."""


@dataclass
class LoRAAdapter:
    name: str
    path: Path
    rank: int
    scale: float
    # (layer index in the whole model, "qkv" | "o" | "gate_up" | "down") -> (A [R, in], B [out, R])
    factors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.factors.values())


def _config(name: str, path: Path, max_rank: int) -> tuple[int, float]:
    cfg_path = path / "adapter_config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise LoRAError(f"adapter {name!r}: no adapter_config.json in {path}") from None
    except (OSError, ValueError) as e:
        raise LoRAError(f"adapter {name!r}: {cfg_path} is not readable JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise LoRAError(f"adapter {name!r}: {cfg_path} is not a JSON object")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAError(f"adapter {name!r}: peft_type {peft_type} is not LoRA")
    try:
        r, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    except (KeyError, TypeError, ValueError) as e:
        raise LoRAError(f"adapter {name!r}: adapter_config.json needs an integer r (and a number lora_alpha)") from e
    if not 1 <= r <= max_rank:
        raise LoRAError(f"adapter {name!r}: rank {r} is above --max-lora-rank {max_rank}" if r > max_rank
                        else f"adapter {name!r}: rank {r} must be >= 1")
    refused = [(cfg.get("use_dora"), "DoRA (use_dora)"), (cfg.get("rank_pattern"), "per-module ranks (rank_pattern)"),
               (cfg.get("alpha_pattern"), "per-module alphas (alpha_pattern)"),
               (cfg.get("bias", "none") not in (None, "none"), f"trained biases (bias={cfg.get('bias')!r})"),
               (cfg.get("modules_to_save"), f"fully trained modules (modules_to_save={cfg.get('modules_to_save')})"),
               (cfg.get("fan_in_fan_out"), "fan_in_fan_out weights"),
               (cfg.get("layers_to_transform") is not None, "layers_to_transform")]
    for bad, what in refused:
        if bad:
            raise LoRAError(f"adapter {name!r}: {what} is not supported")
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return r, scale


def _tensors(name: str, path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    f = path / "adapter_model.safetensors"
    if not f.is_file():
        also = " (adapter_model.bin is not read: save with safe_serialization)" if (path / "adapter_model.bin").exists() else ""
        raise LoRAError(f"adapter {name!r}: no adapter_model.safetensors in {path}{also}")
    try:
        return load_file(str(f))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise LoRAError(f"adapter {name!r}: {f} is not a readable safetensors file: {e}") from e


def read_adapter(name: str, path: str | Path, model: DecoderModel, max_rank: int) -> LoRAAdapter:
    """Read and check an adapter against `model`; its factors on the model's device and dtype."""
    path = Path(path)
    r, scale = _config(name, path, max_rank)
    tensors = _tensors(name, path)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise LoRAError(f"adapter {name!r}: {key} adapts a module splitfire does not (attention q/k/v/o and "
                            "MLP gate/up/down projections only)")
        layer, _, proj, ab = m.groups()
        found.setdefault((int(layer), proj), {})[ab] = t
    if not found:
        raise LoRAError(f"adapter {name!r}: adapter_model.safetensors holds no LoRA factors")
    cfg = model.cfg
    adapter = LoRAAdapter(name, path, r, scale)
    device, dtype = model.norm.weight.device, model.dtype
    by_linear: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for (layer, proj), ab in sorted(found.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"adapter {name!r}: layer {layer} {proj}_proj has lora_{'A' if 'A' not in ab else 'B'} "
                            "missing")
        if not 0 <= layer < cfg.num_layers:
            raise LoRAError(f"adapter {name!r}: layer {layer} does not exist (the model has {cfg.num_layers}): "
                            "made for another base model?")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r:
            raise LoRAError(f"adapter {name!r}: layer {layer} {proj}_proj factors A{tuple(a.shape)} B{tuple(b.shape)} "
                            f"are not of rank {r}")
        linear, part = _PLACE[proj]
        by_linear.setdefault((layer, linear), {})[part] = (a, b)
    for (layer, linear), parts in by_linear.items():
        if layer not in model.layer_ids:
            continue  # (another pipeline stage's layer)
        block = model.layers[layer - model.layer_ids.start]
        if linear in ("qkv", "o") and not isinstance(block.attn, Attention):
            raise LoRAError(f"adapter {name!r}: layer {layer}'s attention is latent attention, which takes no "
                            "LoRA adapters yet")
        if linear in ("gate_up", "down") and not isinstance(block.mlp, MLP):
            raise LoRAError(f"adapter {name!r}: layer {layer}'s MLP is a mixture of experts, which takes no "
                            "LoRA adapters yet")
        target = getattr(block.attn if linear in ("qkv", "o") else block.mlp, linear)
        # Each part's size in the whole model, the rows of it this rank computes (tensor parallel: a
        # column-parallel projection's heads or intermediate columns), and the input columns this
        # rank multiplies (a row-parallel projection's slice; its partial delta is summed with the rest).
        if linear in ("qkv", "o"):
            att = block.attn
            assert isinstance(att, Attention)
            d = att.head_dim
            q_rows = range(att.q_heads.start * d, att.q_heads.stop * d)
            kv_rows = range(att.kv_heads.start * d, att.kv_heads.stop * d)
            if linear == "qkv":
                sizes, heads = [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d], [cfg.num_heads,
                                                                                               cfg.num_kv_heads, 0]
                rows, cols = [q_rows, kv_rows, kv_rows], range(cfg.hidden_size)
            else:
                sizes, heads, rows, cols = [cfg.hidden_size], [0], [range(cfg.hidden_size)], q_rows
            in_full = cfg.num_heads * d if linear == "o" else cfg.hidden_size
        else:
            mlp = block.mlp
            assert isinstance(mlp, MLP)
            inter = cfg.intermediate_size
            if linear == "gate_up":
                sizes, heads, rows, cols = [inter, inter], [0, 0], [mlp.columns, mlp.columns], range(cfg.hidden_size)
            else:
                sizes, heads, rows, cols = [cfg.hidden_size], [0], [range(cfg.hidden_size)], mlp.columns
            in_full = inter if linear == "down" else cfg.hidden_size
        n_parts = len(sizes)
        a_cat = torch.zeros(n_parts * r, target.in_features, dtype=torch.float32)
        b_full = torch.zeros(target.out_features, n_parts * r, dtype=torch.float32)
        row = 0
        for p, (size, h, part_rows) in enumerate(zip(sizes, heads, rows, strict=True)):
            local = len(part_rows)
            if p in parts:
                a, b = parts[p]
                if a.shape[1] != in_full or b.shape[0] != size:
                    proj = next(k for k, v in _PLACE.items() if v == (linear, p))
                    raise LoRAError(f"adapter {name!r}: layer {layer} {proj}_proj factors A{tuple(a.shape)} "
                                    f"B{tuple(b.shape)} do not fit its {in_full} -> {size} projection: "
                                    "made for another base model?")
                b = b.float() * scale
                if h:
                    b = interleave_rope_rows(b, h)
                a_cat[p * r : (p + 1) * r] = a.float()[:, cols.start : cols.stop]
                b_full[row : row + local, p * r : (p + 1) * r] = b[part_rows.start : part_rows.stop]
            row += local
        adapter.factors[(layer, linear)] = (a_cat.to(device, dtype), b_full.to(device, dtype))
    return adapter
