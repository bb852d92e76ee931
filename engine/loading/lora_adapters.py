"""LoRA adapters in the Hugging Face PEFT layout, read and checked against the served model.

A directory holds `adapter_config.json` (rank `r`, `lora_alpha`, `use_rslora`, `target_modules`, ...)
and `adapter_model.safetensors` with `...layers.{i}.self_attn.{q,k,v,o}_proj.lora_{A,B}.weight` and
`...layers.{i}.mlp.{gate,up,down}_proj.lora_{A,B}.weight` (A `[r, in]`, B `[out, r]`); latent attention
(DeepSeek-V2/V3, Kimi-K2) has `q_proj` or `q_a_proj` + `q_b_proj`, `kv_a_proj_with_mqa`, `kv_b_proj` and `o_proj`, a
mixture of experts' shared expert `mlp.shared_expert(s).{gate,up,down}_proj`. Each adapter becomes, per
projection of the model (`DecoderModel.lora_targets`), one A and one B ready for `LoRAWeights.set`: the
scale (`alpha / r`, or `alpha / sqrt(r)` with rsLoRA) folded into B; B rows that feed RoPE put in the
order this model keeps them in (interleaved pairs: `decoder.interleave_rope_rows`, and latent
attention's per-head rope rows as the loader reorders them); fused projections' parts side by side
(`engine/model/lora.py`).

Everything that cannot be served exactly is refused by name (`LoRAError`, a 400 at the edge): a
missing or unreadable file, a rank above `--max-lora-rank`, DoRA, per-module rank or alpha patterns,
trained biases, extra saved modules, a target this model lacks or that splitfire does not adapt
(per-expert modules of transformers-4 layouts, embeddings, the LM head), and factors whose shapes do not fit (an adapter made
for another base model). Routed experts are read in peft's layout for stacked expert parameters
(`_expert_factors`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.errors import RequestError
from engine.loading.weights import rope_rows_perm
from engine.model.decoder import Attention, DecoderModel, interleave_rope_rows
from engine.model.layers import MLP
from engine.model.mla import MLAttention
from engine.model.moe import MoE

_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(shared_experts?\.)?(q_a_proj|q_b_proj|kv_a_proj_with_mqa|"
                  r"kv_b_proj|q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_(A|B)(?:\.default)?\.weight$")
# A projection's place in each kind of layer: (the fused linear's name, the part's index among its parts)
_ATTENTION = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0)}
_LATENT = {"q_proj": ("qkv_a", 0), "q_a_proj": ("qkv_a", 0), "kv_a_proj_with_mqa": ("qkv_a", 1),
           "q_b_proj": ("q_b", 0), "kv_b_proj": ("kv_b", 0), "o_proj": ("o", 0)}
_MLP = {"gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
# peft's LoRA on the stacked routed-expert parameters (`target_parameters`: gate_up_proj, down_proj), one
# wrapper inside the other: `experts.lora_*` and `experts.base_layer.lora_*`.
_EXPERT_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts((?:\.base_layer)*)\.lora_(A|B)(?:\.default)?\.weight$")
_FUSED_GATE_UP = r".*\.gate_up_proj"  # the one per-module pattern peft writes: gate and up fused, rank x 2


@dataclass(frozen=True)
class _Part:
    """One projection inside a (fused) linear: its output size in the whole model, the rows of it this
    rank computes, and how B's rows are reordered to this model's order (None: as they are)."""

    size: int
    rows: range
    reorder: Callable[[torch.Tensor], torch.Tensor] | None = None


def _place(name: str, layer: int, block, where: str, proj: str) -> tuple[str, int]:
    """(linear name, part) of `proj` in `block`, or LoRAError naming why it takes no adapter."""
    attn, mlp = block.attn, block.mlp
    if where == "self_attn":
        if isinstance(attn, MLAttention):
            if proj in ("q_proj", "q_a_proj") and (proj == "q_a_proj") != (attn.q_b is not None):
                raise LoRAError(f"adapter {name!r}: layer {layer} has no {proj} (made for another base model?)")
            table = _LATENT
        else:
            table = _ATTENTION
        if proj not in table:
            raise LoRAError(f"adapter {name!r}: layer {layer} has no {proj} (made for another base model?)")
        return table[proj]
    if proj not in _MLP:
        raise LoRAError(f"adapter {name!r}: layer {layer} mlp has no {proj}")
    linear, part = _MLP[proj]
    if where == "mlp.shared":
        if not (isinstance(mlp, MoE) and mlp.shared is not None):
            raise LoRAError(f"adapter {name!r}: layer {layer} has no shared expert")
        return "shared." + linear, part
    if isinstance(mlp, MoE):
        raise LoRAError(f"adapter {name!r}: layer {layer}'s MLP is a mixture of experts: it has no {proj} of its "
                        "own (its routed experts are adapted through peft's target_parameters, its shared expert "
                        "as mlp.shared_expert(s))")
    return linear, part


def _geometry(model: DecoderModel, block, linear: str) -> tuple[list[_Part], range, int]:
    """A LoRA target's parts, the input columns this rank multiplies (tensor parallel: a row-parallel
    projection's slice; its partial delta is summed with the rest) and the whole input size."""
    cfg = model.cfg
    hidden = range(cfg.hidden_size)
    attn = block.attn
    if isinstance(attn, Attention) and linear in ("qkv", "o"):
        d = attn.head_dim
        q_rows = range(attn.q_heads.start * d, attn.q_heads.stop * d)
        kv_rows = range(attn.kv_heads.start * d, attn.kv_heads.stop * d)
        if linear == "qkv":
            return ([_Part(cfg.num_heads * d, q_rows, lambda b: interleave_rope_rows(b, cfg.num_heads)),
                     _Part(cfg.num_kv_heads * d, kv_rows, lambda b: interleave_rope_rows(b, cfg.num_kv_heads)),
                     _Part(cfg.num_kv_heads * d, kv_rows)], hidden, cfg.hidden_size)
        return [_Part(cfg.hidden_size, hidden)], q_rows, cfg.num_heads * d
    if isinstance(attn, MLAttention) and linear in ("qkv_a", "q_b", "kv_b", "o"):
        m = cfg.mla
        assert m is not None
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        heads = attn.head_range

        def per_head(n: int) -> range:
            return range(heads.start * n, heads.stop * n)

        def rope(n_heads: int, rows: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
            if m.rope_interleaved:
                return None
            perm = rope_rows_perm(n_heads, rows, m.qk_rope_head_dim)
            return lambda b: b[perm]

        kv_rows = m.kv_lora_rank + m.qk_rope_head_dim
        if linear == "qkv_a":
            q = (_Part(m.q_lora_rank, range(m.q_lora_rank)) if m.q_lora_rank
                 else _Part(cfg.num_heads * qk, per_head(qk), rope(cfg.num_heads, qk)))
            return [q, _Part(kv_rows, range(kv_rows), rope(1, kv_rows))], hidden, cfg.hidden_size
        if linear == "kv_b":  # split by head like the base's (no RoPE rows: the keys' rope part is k_r)
            per = m.qk_nope_head_dim + m.v_head_dim
            return [_Part(cfg.num_heads * per, per_head(per))], range(m.kv_lora_rank), m.kv_lora_rank
        if linear == "q_b":
            return ([_Part(cfg.num_heads * qk, per_head(qk), rope(cfg.num_heads, qk))], range(m.q_lora_rank),
                    m.q_lora_rank)
        return [_Part(cfg.hidden_size, hidden)], per_head(m.v_head_dim), cfg.num_heads * m.v_head_dim
    shared = linear.startswith("shared.")
    mlp = block.mlp.shared if shared else block.mlp
    assert isinstance(mlp, MLP)
    inter = cfg.moe.shared_intermediate_size if shared and cfg.moe is not None else cfg.intermediate_size
    if linear.endswith("gate_up"):
        return [_Part(inter, mlp.columns), _Part(inter, mlp.columns)], hidden, cfg.hidden_size
    return [_Part(cfg.hidden_size, hidden)], mlp.columns, inter


class LoRAError(RequestError):
    """An adapter that cannot be served as it is (the message names the adapter and the problem)."""


@dataclass
class LoRAAdapter:
    name: str
    path: Path
    rank: int
    scale: float
    # (layer index in the whole model, `DecoderModel.lora_targets` name) -> (A [R, in], B [out, R])
    factors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # layer index -> this rank's routed experts' (gate/up A [E, r2, H], B [E, 2I, r2], down A [E, r, I], B [E, H, r])
    expert_factors: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return (sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.factors.values())
                + sum(t.numel() * t.element_size() for ts in self.expert_factors.values() for t in ts))


def _config(name: str, path: Path, max_rank: int) -> tuple[int, float, dict]:
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
    patterns = {k: cfg.get(k) or {} for k in ("rank_pattern", "alpha_pattern")}
    # peft fuses an MoE's gate and up experts (one parameter) and writes rank and alpha x 2 for them: that
    # one pattern is the same per-projection LoRA; any other per-module rank or alpha is refused.
    fused = {_FUSED_GATE_UP}
    odd = {k: set(v) - fused for k, v in patterns.items()}
    refused = [(cfg.get("use_dora"), "DoRA (use_dora)"), (odd["rank_pattern"], "per-module ranks (rank_pattern)"),
               (odd["alpha_pattern"], "per-module alphas (alpha_pattern)"),
               (cfg.get("bias", "none") not in (None, "none"), f"trained biases (bias={cfg.get('bias')!r})"),
               (cfg.get("modules_to_save"), f"fully trained modules (modules_to_save={cfg.get('modules_to_save')})"),
               (cfg.get("fan_in_fan_out"), "fan_in_fan_out weights"),
               (cfg.get("layers_to_transform") is not None, "layers_to_transform")]
    for bad, what in refused:
        if bad:
            raise LoRAError(f"adapter {name!r}: {what} is not supported")
    rslora = bool(cfg.get("use_rslora"))
    scale = alpha / math.sqrt(r) if rslora else alpha / r
    r_gu = int(patterns["rank_pattern"].get(_FUSED_GATE_UP, r))
    alpha_gu = float(patterns["alpha_pattern"].get(_FUSED_GATE_UP, alpha))
    if not 1 <= r_gu <= 2 * max_rank:
        raise LoRAError(f"adapter {name!r}: fused gate/up experts' rank {r_gu} is above 2 x --max-lora-rank {max_rank}")
    experts = {"gate_up": (r_gu, alpha_gu / math.sqrt(r_gu) if rslora else alpha_gu / r_gu), "down": (r, scale)}
    return r, scale, experts


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
    r, scale, expert_ranks = _config(name, path, max_rank)
    tensors = _tensors(name, path)
    found: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    expert_found: dict[int, dict[int, dict[str, torch.Tensor]]] = {}  # layer -> wrapper depth -> A/B
    for key, t in tensors.items():
        em = _EXPERT_KEY.search(key)
        if em is not None:
            layer, depth, ab = em.groups()
            expert_found.setdefault(int(layer), {}).setdefault(depth.count("base_layer"), {})[ab] = t
            continue
        m = _KEY.search(key)
        if m is None:
            raise LoRAError(f"adapter {name!r}: {key} adapts a module splitfire does not (attention projections, "
                            "MLP and shared-expert gate/up/down only)")
        layer, where, shared, proj, ab = m.groups()
        if shared and where != "mlp":
            raise LoRAError(f"adapter {name!r}: {key} adapts a module splitfire does not")
        found.setdefault((int(layer), where + (".shared" if shared else ""), proj), {})[ab] = t
    if not found and not expert_found:
        raise LoRAError(f"adapter {name!r}: adapter_model.safetensors holds no LoRA factors")
    cfg = model.cfg
    adapter = LoRAAdapter(name, path, r, scale)
    device, dtype = model.norm.weight.device, model.dtype
    by_linear: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor, str]]] = {}
    for (layer, where, proj), ab in sorted(found.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"adapter {name!r}: layer {layer} {proj} has lora_{'A' if 'A' not in ab else 'B'} missing")
        if not 0 <= layer < cfg.num_layers:
            raise LoRAError(f"adapter {name!r}: layer {layer} does not exist (the model has {cfg.num_layers}): "
                            "made for another base model?")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r:
            raise LoRAError(f"adapter {name!r}: layer {layer} {proj} factors A{tuple(a.shape)} B{tuple(b.shape)} "
                            f"are not of rank {r}")
        if layer not in model.layer_ids:
            continue  # (another pipeline stage's layer)
        block = model.layers[layer - model.layer_ids.start]
        linear, part = _place(name, layer, block, where, proj)
        by_linear.setdefault((layer, linear), {})[part] = (a, b, proj)
    targets = {(i, n): lin for i, n, lin, _ in model.lora_targets()}
    for (layer, linear), parts in by_linear.items():
        block = model.layers[layer - model.layer_ids.start]
        target = targets[(layer, linear)]
        geometry, cols, in_full = _geometry(model, block, linear)
        a_cat = torch.zeros(len(geometry) * r, target.in_features, dtype=torch.float32)
        b_full = torch.zeros(target.out_features, len(geometry) * r, dtype=torch.float32)
        row = 0
        for p, g in enumerate(geometry):
            local = len(g.rows)
            if p in parts:
                a, b, proj = parts[p]
                if a.shape[1] != in_full or b.shape[0] != g.size:
                    raise LoRAError(f"adapter {name!r}: layer {layer} {proj} factors A{tuple(a.shape)} "
                                    f"B{tuple(b.shape)} do not fit its {in_full} -> {g.size} projection: "
                                    "made for another base model?")
                b = b.float() * scale
                if g.reorder is not None:
                    b = g.reorder(b)
                a_cat[p * r : (p + 1) * r] = a.float()[:, cols.start : cols.stop]
                b_full[row : row + local, p * r : (p + 1) * r] = b[g.rows.start : g.rows.stop]
            row += local
        adapter.factors[(layer, linear)] = (a_cat.to(device, dtype), b_full.to(device, dtype))
    for layer, wrappers in sorted(expert_found.items()):
        if not 0 <= layer < cfg.num_layers:
            raise LoRAError(f"adapter {name!r}: layer {layer} does not exist (the model has {cfg.num_layers}): "
                            "made for another base model?")
        if layer in model.layer_ids:
            block = model.layers[layer - model.layer_ids.start]
            adapter.expert_factors[layer] = _expert_factors(name, layer, block, wrappers, expert_ranks, device, dtype)
    return adapter


def _expert_factors(name: str, layer: int, block, wrappers: dict[int, dict[str, torch.Tensor]],
                    ranks: dict[str, tuple[int, float]], device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """This rank's routed experts' factors from peft's two parameter wrappers: per expert e,
    A_e = A.view(E, r, in)[e] and B_e = B.view(out, r, E)[..., e] (peft's `ParamWrapper` layout), the scale
    folded into B; tensor parallel: each expert's intermediate columns (gate/up B's rows, down A's columns),
    or with expert parallel this rank's experts."""
    mlp = block.mlp
    if not isinstance(mlp, MoE):
        raise LoRAError(f"adapter {name!r}: layer {layer} adapts routed experts, but its MLP is dense")
    e_all, inter, hidden = mlp.cfg.num_experts, mlp.cfg.intermediate_size, mlp.router.in_features
    by_role: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for depth, ab in wrappers.items():
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"adapter {name!r}: layer {layer} experts (wrapper {depth}) has lora_"
                            f"{'A' if 'A' not in ab else 'B'} missing")
        a, b = ab["A"], ab["B"]
        role = "gate_up" if a.dim() == 2 and a.shape[1] == hidden and b.shape[0] == 2 * inter else "down"
        r_p = ranks[role][0]
        want_a, want_b = (r_p * e_all, hidden if role == "gate_up" else inter), (
            2 * inter if role == "gate_up" else hidden, r_p * e_all)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b or role in by_role:
            raise LoRAError(f"adapter {name!r}: layer {layer} expert factors A{tuple(a.shape)} B{tuple(b.shape)} fit "
                            f"neither gate/up nor down of {e_all} experts ({hidden} -> {2 * inter} -> {hidden}, rank "
                            f"{ranks['down'][0]}): made for another base model?")
        by_role[role] = (a, b)
    local, cols = mlp.local, mlp.columns
    out: list[torch.Tensor] = []
    for role in ("gate_up", "down"):
        r_p, scale = ranks[role]
        a, b = by_role.get(role, (None, None))
        if a is None or b is None:  # (an adapter of one of the two: the other's factors are zeros)
            n_in, n_out = (hidden, 2 * len(cols)) if role == "gate_up" else (len(cols), hidden)
            out += [torch.zeros(len(local), 1, n_in), torch.zeros(len(local), n_out, 1)]
            continue
        a_e = a.float().view(e_all, r_p, -1)[local.start : local.stop]
        b_e = (b.float() * scale).view(b.shape[0], r_p, e_all).permute(2, 0, 1)[local.start : local.stop]
        if role == "gate_up":
            rows = torch.cat((torch.arange(cols.start, cols.stop), inter + torch.arange(cols.start, cols.stop)))
            b_e = b_e[:, rows]
        else:
            a_e = a_e[:, :, cols.start : cols.stop]
        out += [a_e.contiguous(), b_e.contiguous()]
    return tuple(t.to(device, dtype) for t in out)
