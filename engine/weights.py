"""Loading a Hugging Face model directory's safetensors into `DecoderModel`, tensor by tensor.

q/k/v and gate/up are concatenated on load so each runs as one matmul; q/k rows (and q/k norm
weights) are reordered for interleaved RoPE (`model.interleave_rope_rows`). Every checkpoint
tensor is either placed or refused: one left over means the config and the weights disagree
(a bias, a norm or an expert the config does not declare), and that is an error, not a
silently different model.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from tqdm import tqdm

from engine import quant
from engine.checkpoint import Checkpoint
from engine.errors import ModelLoadError
from engine.layers import MLP, Linear, RMSNorm
from engine.model import Block, DecoderModel, interleave_rope_rows
from engine.model_config import VISION_PREFIXES, ModelConfig
from engine.moe import MoE

# Tensors some checkpoints carry that hold nothing a forward pass reads.
_INERT_SUFFIXES = ("rotary_emb.inv_freq",)


class _Loader:
    """Checks each tensor's shape against the config, then reads it straight into its parameter."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt

    def _check(self, name: str, shape: tuple[int, ...]) -> None:
        found = self.ckpt.shape(name)
        if found != tuple(shape):
            path = self.ckpt.info(name).path
            raise ModelLoadError(f"{path}: tensor {name!r} has shape {found}, the config implies {tuple(shape)}")

    def is_quantized(self, name: str) -> bool:
        return not self.ckpt.has(name) and self.ckpt.has(name + ".qweight")

    def quantized(self, name: str, shape: tuple[int, ...], rope_heads: int = 0) -> quant.QuantizedWeight:
        """Tensor `name` stored quantized (`quant`'s checkpoint layout), rows reordered for RoPE if asked."""
        mins = name + ".mins"
        try:
            qw = quant.QuantizedWeight.from_parts(self.ckpt.get(name + ".qweight"), self.ckpt.get(name + ".scales"),
                                                  self.ckpt.get(mins) if self.ckpt.has(mins) else None)
        except ModelLoadError as e:
            raise ModelLoadError(f"{self.ckpt.model_dir}: tensor {name!r}: {e}") from e
        if qw.shape != tuple(shape):
            raise ModelLoadError(f"{self.ckpt.model_dir}: quantized tensor {name!r} has shape {qw.shape}, "
                                 f"the config implies {tuple(shape)}")
        if rope_heads:
            qw = qw.map_rows(lambda t: interleave_rope_rows(t, rope_heads))
        return qw

    def copy(self, dst: torch.Tensor, name: str, rope_heads: int = 0) -> None:
        """dst <- tensor `name`; with `rope_heads`, its rows are then reordered for interleaved RoPE.
        A quantized tensor landing here (experts, routers) is dequantized into the float parameter."""
        if self.is_quantized(name):
            dst.copy_(self.quantized(name, tuple(dst.shape), rope_heads).dequantize())
            return
        self._check(name, tuple(dst.shape))
        self.ckpt.read_into(name, dst)
        if rope_heads:
            dst.copy_(interleave_rope_rows(dst, rope_heads))

    def linear(self, lin: Linear, names: list[str], rows: list[int] | None = None,
               rope_heads: list[int] | None = None) -> None:
        """A linear layer's weight from one tensor or row blocks of several (fused q/k/v, gate/up).
        Quantized in the checkpoint: kept quantized (a float block among them is quantized to int8)."""
        if not any(self.is_quantized(n) for n in names):
            self.fused(lin.weight, names, rows, rope_heads)
            return
        k = lin.weight.shape[1]
        rows = rows or [lin.weight.shape[0] // len(names)] * len(names)
        parts = []
        for i, (name, n) in enumerate(zip(names, rows, strict=True)):
            heads = rope_heads[i] if rope_heads else 0
            if self.is_quantized(name):
                parts.append(self.quantized(name, (n, k), heads))
            else:
                w = torch.empty(n, k)
                self.copy(w, name, heads)
                parts.append(quant.quantize(w, "int8", quant.group_size_for(k, "int8")))
        lin.set_quantized(parts)

    def norm(self, norm: RMSNorm | None, name: str, rope_interleaved: bool = False) -> None:
        assert norm is not None
        self._check(name, tuple(norm.weight.shape))
        w = self.ckpt.get(name)
        norm.load(interleave_rope_rows(w, 1) if rope_interleaved else w, name)

    def fused(self, dst: torch.Tensor, names: list[str], rows: list[int] | None = None,
              rope_heads: list[int] | None = None) -> None:
        """Consecutive row blocks of `dst` (a fused q/k/v or gate/up weight or bias) from several
        tensors, `rows[i]` rows each (default: equal parts)."""
        rows = rows or [dst.shape[0] // len(names)] * len(names)
        start = 0
        for i, (name, n) in enumerate(zip(names, rows, strict=True)):
            self.copy(dst[start : start + n], name, rope_heads[i] if rope_heads else 0)
            start += n

    def mlp(self, mlp: MLP, prefix: str, names: tuple[str, str, str], bias: bool = False) -> None:
        gate, up, down = (prefix + n for n in names)
        self.linear(mlp.gate_up, [f"{gate}.weight", f"{up}.weight"])
        self.linear(mlp.down, [down + ".weight"])
        if bias:
            assert mlp.gate_up.bias is not None and mlp.down.bias is not None
            self.fused(mlp.gate_up.bias, [f"{gate}.bias", f"{up}.bias"])
            self.copy(mlp.down.bias, down + ".bias")


def load_model(model_dir: str | Path, device: torch.device, dtype: torch.dtype,
               quantization: str | None = None) -> DecoderModel:
    """`quantization` (int8 | int4) quantizes a float checkpoint's matmul weights after loading; a
    checkpoint stored quantized (`engine.quant`'s layout, e.g. a converted GGUF) stays as stored."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    ckpt = Checkpoint(model_dir)
    model = _allocate(cfg, device, dtype)
    load = _Loader(ckpt)
    root, head = _text_model_prefixes(ckpt, cfg)
    with torch.no_grad():
        embed = root + "embed_tokens.weight"
        if load.is_quantized(embed):
            model.set_embedding_quantized(load.quantized(embed, tuple(model.embed.weight.shape)).to(device))
        else:
            load.copy(model.embed.weight, embed)
        load.norm(model.norm, root + "norm.weight")
        if cfg.tie_word_embeddings:
            ckpt.skip(head)  # some tied checkpoints store a copy; the embedding is what runs
            for suffix in quant.SUFFIXES:
                ckpt.skip(head + suffix)
        else:
            load.linear(model.lm_head, [head if ckpt.has(head) or ckpt.has(head + ".qweight") else embed])
        for i, layer in enumerate(tqdm(model.layers, desc=f"loading {model_dir.name}", unit="layer", disable=None)):
            _load_block(load, cfg, layer, f"{root}layers.{i}.")
        if quantization is not None:
            model.quantize(quantization)
    unread = sorted(n for n in ckpt.unread if not n.endswith(_INERT_SUFFIXES)
                    and not (cfg.checkpoint_prefix and n.startswith(VISION_PREFIXES)))
    if unread:
        raise ModelLoadError(f"{model_dir}: {len(unread)} checkpoint tensor(s) the config does not account for, "
                             f"e.g. {unread[:4]} (a config field splitfire did not read, or the wrong config.json?)")
    model.eval()
    if device.type == "cpu":
        model.optimize_for_cpu()
        _return_freed_heap()
    return model


def _return_freed_heap() -> None:
    """Give the heap pages freed by packing back to the OS (glibc keeps them otherwise: measured
    +12 MiB resident for a 50 MiB model)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc: nothing to trim
    libc.malloc_trim(0)


def _text_model_prefixes(ckpt: Checkpoint, cfg: ModelConfig) -> tuple[str, str]:
    """(prefix of the decoder's tensors, name of the LM head). Multimodal checkpoints nest the text
    model as `language_model.model.*` (transformers 4 layout) or `model.language_model.*` (5)."""
    p = cfg.checkpoint_prefix
    if not p:
        return "model.", "lm_head.weight"
    if ckpt.has(f"model.{p}embed_tokens.weight"):
        return f"model.{p}", "lm_head.weight"
    return f"{p}model.", f"{p}lm_head.weight"


def _allocate(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> DecoderModel:
    """The model's parameters, uninitialised, made directly on `device` in `dtype` (no module runs a
    random init; building on "meta" and moving would touch every page twice)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return DecoderModel(cfg)
    finally:
        torch.set_default_dtype(default)


def _load_block(load: _Loader, cfg: ModelConfig, layer: Block, p: str) -> None:
    load.norm(layer.attn_norm, p + "input_layernorm.weight")
    if cfg.sandwich_norm:
        load.norm(layer.attn_post_norm, p + "post_attention_layernorm.weight")
        load.norm(layer.mlp_norm, p + "pre_feedforward_layernorm.weight")
        load.norm(layer.mlp_post_norm, p + "post_feedforward_layernorm.weight")
    else:
        load.norm(layer.mlp_norm, p + "post_attention_layernorm.weight")

    a, h, kvh = layer.attn, cfg.num_heads, cfg.num_kv_heads
    names = [f"{p}self_attn.{n}_proj" for n in "qkv"]
    load.linear(a.qkv, [n + ".weight" for n in names], list(a.split), rope_heads=[h, kvh, 0])
    if cfg.qkv_bias:
        assert a.qkv.bias is not None
        load.fused(a.qkv.bias, [n + ".bias" for n in names], list(a.split), rope_heads=[h, kvh, 0])
    load.linear(a.o, [p + "self_attn.o_proj.weight"])
    if cfg.o_bias:
        assert a.o.bias is not None
        load.copy(a.o.bias, p + "self_attn.o_proj.bias")
    if cfg.qk_norm:
        load.norm(a.q_norm, p + "self_attn.q_norm.weight", rope_interleaved=True)
        load.norm(a.k_norm, p + "self_attn.k_norm.weight", rope_interleaved=True)

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
    if ckpt.has(prefix + "experts.gate_up_proj"):
        load.copy(ex.gate_up, prefix + "experts.gate_up_proj")
        load.copy(ex.down, prefix + "experts.down_proj")
    else:
        gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        for e in range(ex.num_experts):
            ep = f"{prefix}experts.{e}."
            load.fused(ex.gate_up[e], [f"{ep}{gate}.weight", f"{ep}{up}.weight"])
            load.copy(ex.down[e], f"{ep}{down}.weight")
    if moe.shared is not None and moe.shared_gate is not None:
        load.mlp(moe.shared, prefix + "shared_expert.", ("gate_proj", "up_proj", "down_proj"))
        load.copy(moe.shared_gate.weight, prefix + "shared_expert_gate.weight")
