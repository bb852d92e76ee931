"""Loading a Hugging Face model directory's safetensors into `DecoderModel`, tensor by tensor.

q/k/v and gate/up are concatenated on load so each runs as one matmul; q/k rows (and q/k norm
weights) are reordered for interleaved RoPE (`model.interleave_rope_rows`). Every checkpoint
tensor is either placed or refused: one left over means the config and the weights disagree
(a bias, a norm or an expert the config does not declare), and that is an error, not a
silently different model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from engine.checkpoint import Checkpoint
from engine.errors import ModelLoadError
from engine.layers import MLP, RMSNorm
from engine.model import Block, DecoderModel, interleave_rope_rows
from engine.model_config import ModelConfig
from engine.moe import MoE

# Tensors some checkpoints carry that hold nothing a forward pass reads.
_INERT_SUFFIXES = ("rotary_emb.inv_freq",)


class _Loader:
    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        found = self.ckpt.shape(name)
        if found != tuple(shape):
            path = self.ckpt.info(name).path
            raise ModelLoadError(f"{path}: tensor {name!r} has shape {found}, the config implies {tuple(shape)}")
        return self.ckpt.get(name)

    def copy(self, dst: torch.Tensor, name: str) -> None:
        dst.copy_(self.get(name, tuple(dst.shape)))

    def norm(self, norm: RMSNorm | None, name: str, heads_interleaved: bool = False) -> None:
        assert norm is not None
        w = self.get(name, tuple(norm.weight.shape))
        norm.load(interleave_rope_rows(w, 1) if heads_interleaved else w, name)

    def mlp(self, mlp: MLP, prefix: str, names: tuple[str, str, str], bias: bool = False) -> None:
        gate, up, down = (prefix + n for n in names)
        inter, hidden = mlp.down.weight.shape[1], mlp.down.weight.shape[0]
        mlp.gate_up.weight.copy_(torch.cat([self.get(f"{n}.weight", (inter, hidden)) for n in (gate, up)]))
        self.copy(mlp.down.weight, down + ".weight")
        if bias:
            assert mlp.gate_up.bias is not None and mlp.down.bias is not None
            mlp.gate_up.bias.copy_(torch.cat([self.get(f"{n}.bias", (inter,)) for n in (gate, up)]))
            self.copy(mlp.down.bias, down + ".bias")


def load_model(model_dir: str | Path, device: torch.device, dtype: torch.dtype) -> DecoderModel:
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    ckpt = Checkpoint(model_dir)
    with torch.device("meta"):
        model = DecoderModel(cfg)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    load = _Loader(ckpt)
    with torch.no_grad():
        load.copy(model.embed.weight, "model.embed_tokens.weight")
        load.norm(model.norm, "model.norm.weight")
        if cfg.tie_word_embeddings:
            ckpt.skip("lm_head.weight")  # some tied checkpoints store a copy; the embedding is what runs
        else:
            load.copy(model.lm_head.weight, "lm_head.weight" if ckpt.has("lm_head.weight") else "model.embed_tokens.weight")
        for i, layer in enumerate(tqdm(model.layers, desc=f"loading {model_dir.name}", unit="layer", disable=None)):
            _load_block(load, cfg, layer, f"model.layers.{i}.")
    unread = sorted(n for n in ckpt.unread if not n.endswith(_INERT_SUFFIXES))
    if unread:
        raise ModelLoadError(f"{model_dir}: {len(unread)} checkpoint tensor(s) the config does not account for, "
                             f"e.g. {unread[:4]} (a config field splitfire did not read, or the wrong config.json?)")
    model.eval()
    if device.type == "cpu":
        model.optimize_for_cpu()
    return model


def _load_block(load: _Loader, cfg: ModelConfig, layer: Block, p: str) -> None:
    load.norm(layer.attn_norm, p + "input_layernorm.weight")
    if cfg.sandwich_norm:
        load.norm(layer.attn_post_norm, p + "post_attention_layernorm.weight")
        load.norm(layer.mlp_norm, p + "pre_feedforward_layernorm.weight")
        load.norm(layer.mlp_post_norm, p + "post_feedforward_layernorm.weight")
    else:
        load.norm(layer.mlp_norm, p + "post_attention_layernorm.weight")

    a, h, kvh, d, hidden = layer.attn, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    q = interleave_rope_rows(load.get(p + "self_attn.q_proj.weight", (h * d, hidden)), h)
    k = interleave_rope_rows(load.get(p + "self_attn.k_proj.weight", (kvh * d, hidden)), kvh)
    v = load.get(p + "self_attn.v_proj.weight", (kvh * d, hidden))
    a.qkv.weight.copy_(torch.cat((q, k, v)))
    if cfg.qkv_bias:
        assert a.qkv.bias is not None
        qb = interleave_rope_rows(load.get(p + "self_attn.q_proj.bias", (h * d,)), h)
        kb = interleave_rope_rows(load.get(p + "self_attn.k_proj.bias", (kvh * d,)), kvh)
        a.qkv.bias.copy_(torch.cat((qb, kb, load.get(p + "self_attn.v_proj.bias", (kvh * d,)))))
    load.copy(a.o.weight, p + "self_attn.o_proj.weight")
    if cfg.o_bias:
        assert a.o.bias is not None
        load.copy(a.o.bias, p + "self_attn.o_proj.bias")
    if cfg.qk_norm:
        load.norm(a.q_norm, p + "self_attn.q_norm.weight", heads_interleaved=True)
        load.norm(a.k_norm, p + "self_attn.k_norm.weight", heads_interleaved=True)

    if isinstance(layer.mlp, MoE):
        _load_moe(load, cfg, layer.mlp, p)
    else:
        assert isinstance(layer.mlp, MLP)
        load.mlp(layer.mlp, p + "mlp.", ("gate_proj", "up_proj", "down_proj"), bias=cfg.mlp_bias)


def _load_moe(load: _Loader, cfg: ModelConfig, moe: MoE, p: str) -> None:
    """Experts as checkpoints store them: one tensor per expert and projection (Qwen: gate/up/down_proj,
    Mixtral: w1/w3/w2 under block_sparse_moe), or already stacked (`experts.gate_up_proj` [E, 2I, H],
    `experts.down_proj` [E, H, I], as transformers 5 holds them in memory)."""
    ckpt = load.ckpt
    mixtral = ckpt.has(p + "block_sparse_moe.gate.weight")
    prefix = p + ("block_sparse_moe." if mixtral else "mlp.")
    load.copy(moe.router.weight, prefix + "gate.weight")
    ex = moe.experts
    num, inter, hidden = ex.gate_up.shape[0], ex.gate_up.shape[1] // 2, ex.gate_up.shape[2]
    if ckpt.has(prefix + "experts.gate_up_proj"):
        load.copy(ex.gate_up, prefix + "experts.gate_up_proj")
        load.copy(ex.down, prefix + "experts.down_proj")
    else:
        gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        for e in range(num):
            ep = f"{prefix}experts.{e}."
            ex.gate_up[e, :inter].copy_(load.get(f"{ep}{gate}.weight", (inter, hidden)))
            ex.gate_up[e, inter:].copy_(load.get(f"{ep}{up}.weight", (inter, hidden)))
            load.copy(ex.down[e], f"{ep}{down}.weight")
    if moe.shared is not None and moe.shared_gate is not None:
        load.mlp(moe.shared, prefix + "shared_expert.", ("gate_proj", "up_proj", "down_proj"))
        load.copy(moe.shared_gate.weight, prefix + "shared_expert_gate.weight")
