"""Loading a Hugging Face model directory's safetensors into `DecoderModel`, tensor by tensor.

q/k/v and gate/up are concatenated on load so each runs as one matmul; q/k rows (and q/k norm
weights) are reordered for interleaved RoPE (`model.interleave_rope_rows`). Every checkpoint
tensor is either placed or refused: one left over means the config and the weights disagree
(a bias, a norm or an expert the config does not declare), and that is an error, not a
silently different model.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from tqdm import tqdm

from common.errors import ModelLoadError
from engine.loading import weight_cache
from engine.loading.checkpoint import Checkpoint
from engine.loading.staging import Staging
from engine.model import quant
from engine.model.decoder import Attention, Block, DecoderModel, interleave_rope_rows
from engine.model.layers import MLP, Linear, RMSNorm
from engine.model.mla import MLAttention
from engine.model.model_config import VISION_PREFIXES, ModelConfig
from engine.model.moe import MoE
from engine.model.parallel import ONE, WHOLE, Shard, Stage

log = logging.getLogger("splitfire.engine")

# Tensors some checkpoints carry that hold nothing a forward pass reads.
_INERT_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Part:
    """The slice of a stored tensor a tensor-parallel rank loads: `full` is the whole tensor's shape as
    the config implies it (checked against the checkpoint); rows past `full[0]` (the last rank's share
    of a vocabulary that does not divide evenly) load as zeros."""

    full: tuple[int, ...]
    rows: range | None = None
    cols: range | None = None

    def clipped(self) -> Part:
        if self.rows is None or self.rows.stop <= self.full[0]:
            return self
        return Part(self.full, range(self.rows.start, min(self.rows.stop, self.full[0])), self.cols)


class _Loader:
    """Checks each tensor's shape against the config, then reads it straight into its parameter."""

    def __init__(self, ckpt: Checkpoint, fp8_block: tuple[int, int] | None = None):
        self.ckpt = ckpt
        self.fp8_block = fp8_block

    def is_fp8(self, name: str) -> bool:
        return self.ckpt.has(name) and self.ckpt.info(name).dtype in (torch.float8_e4m3fn, torch.float8_e5m2)

    def fp8(self, name: str, shape: tuple[int, ...]) -> quant.QuantizedWeight:
        """An FP8 weight as stored: e4m3 codes and the `weight_scale_inv` of each (rows, cols) block of
        the config's weight_block_size (trailing blocks may be partial, as DeepSeek's 576-row
        kv_a_proj_with_mqa), in `quant`'s per-row layout."""
        self._check(name, shape)
        scale_name = name + "_scale_inv"
        if self.fp8_block is None or not self.ckpt.has(scale_name):
            raise ModelLoadError(f"{self.ckpt.model_dir}: tensor {name!r} is FP8 without a block-wise "
                                 f"{scale_name!r} (and a quantization_config.weight_block_size)")
        if len(shape) != 2:
            raise ModelLoadError(f"{self.ckpt.model_dir}: FP8 tensor {name!r} of shape {shape}: only 2-D FP8 "
                                 "weights are read (stacked FP8 experts are not)")
        if self.ckpt.info(name).dtype != torch.float8_e4m3fn:
            raise ModelLoadError(f"{self.ckpt.model_dir}: FP8 tensor {name!r} is {self.ckpt.info(name).dtype}; "
                                 "only e4m3 (float8_e4m3fn) weights are read")
        try:
            return quant.from_block_fp8(self.ckpt.get(name), self.ckpt.get(scale_name), self.fp8_block)
        except ModelLoadError as e:
            raise ModelLoadError(f"{self.ckpt.model_dir}: tensor {name!r}: {e}") from e

    def _check(self, name: str, shape: tuple[int, ...]) -> None:
        found = self.ckpt.shape(name)
        if found != tuple(shape):
            path = self.ckpt.info(name).path
            raise ModelLoadError(f"{path}: tensor {name!r} has shape {found}, the config implies {tuple(shape)}")

    def is_quantized(self, name: str) -> bool:
        """Stored in a format kept as stored: `quant`'s int8/int4 layout, or block-FP8."""
        return (not self.ckpt.has(name) and self.ckpt.has(name + ".qweight")) or self.is_fp8(name)

    def quantized(self, name: str, shape: tuple[int, ...], rope_heads: int = 0) -> quant.QuantizedWeight:
        """Tensor `name` stored quantized (`quant`'s checkpoint layout or block-FP8), rows reordered for
        RoPE if asked."""
        if self.is_fp8(name):
            qw = self.fp8(name, shape)
            return qw.map_rows(lambda t: interleave_rope_rows(t, rope_heads)) if rope_heads else qw
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

    def as_quantized(self, name: str, shape: tuple[int, int], rope_heads: int = 0,
                     part: Part | None = None) -> quant.QuantizedWeight:
        """Tensor `name` as stored if quantized, else (a float tensor among quantized ones) at int8.
        With `part`, `shape` is the slice's."""
        if self.is_quantized(name):
            if part is None:
                return self.quantized(name, shape, rope_heads)
            clip = part.clipped()
            try:
                qw = self.quantized(name, part.full).narrow(clip.rows, clip.cols)
            except ModelLoadError as e:
                raise ModelLoadError(f"{self.ckpt.model_dir}: tensor {name!r}: {e}") from e
            qw = _pad_rows(qw, shape[0])
            return qw.map_rows(lambda t: interleave_rope_rows(t, rope_heads)) if rope_heads else qw
        w = torch.empty(shape)
        self.copy(w, name, rope_heads, part)
        return quant.quantize(w, "int8", quant.group_size_for(shape[1], "int8"))

    def sliced(self, name: str, part: Part, rope_heads: int = 0) -> torch.Tensor:
        """A tensor-parallel rank's slice of tensor `name` (quantized and FP8 ones dequantized), rows
        reordered for interleaved RoPE with `rope_heads` (whole heads per rank: the order is per head)."""
        clip = part.clipped()
        if self.is_quantized(name):
            w = self.quantized(name, part.full).narrow(clip.rows, clip.cols).dequantize()
        else:
            self._check(name, part.full)
            w = self.ckpt.read_part(name, clip.rows, clip.cols)
        return interleave_rope_rows(w, rope_heads) if rope_heads else w

    def copy(self, dst: torch.Tensor, name: str, rope_heads: int = 0, part: Part | None = None) -> None:
        """dst <- tensor `name` (or its `part`); with `rope_heads`, its rows are then reordered for
        interleaved RoPE. A quantized tensor landing here (experts, routers) is dequantized into the
        float parameter."""
        if part is not None:
            w = self.sliced(name, part, rope_heads)
            dst[: w.shape[0]].copy_(w)
            dst[w.shape[0] :].zero_()  # (past the vocabulary: see Part)
            return
        if self.is_quantized(name):
            dst.copy_(self.quantized(name, tuple(dst.shape), rope_heads).dequantize())
            return
        self._check(name, tuple(dst.shape))
        self.ckpt.read_into(name, dst)
        if rope_heads:
            dst.copy_(interleave_rope_rows(dst, rope_heads))

    def linear(self, lin: Linear, names: list[str], rows: list[int] | None = None,
               rope_heads: list[int] | None = None, parts: list[Part] | None = None) -> None:
        """A linear layer's weight from one tensor or row blocks of several (fused q/k/v, gate/up), or
        of their `parts` (tensor parallel). Quantized in the checkpoint: kept quantized (a float block
        among them is quantized to int8)."""
        if not any(self.is_quantized(n) for n in names):
            self.fused(lin.weight, names, rows, rope_heads, parts)
            return
        k = lin.weight.shape[1]
        rows = rows or [lin.weight.shape[0] // len(names)] * len(names)
        lin.set_quantized([self.as_quantized(name, (n, k), rope_heads[i] if rope_heads else 0,
                                             parts[i] if parts else None)
                           for i, (name, n) in enumerate(zip(names, rows, strict=True))])

    def norm(self, norm: RMSNorm | None, name: str, rope_interleaved: bool = False) -> None:
        assert norm is not None
        self._check(name, tuple(norm.weight.shape))
        w = self.ckpt.get(name)
        norm.load(interleave_rope_rows(w, 1) if rope_interleaved else w, name)

    def fused(self, dst: torch.Tensor, names: list[str], rows: list[int] | None = None,
              rope_heads: list[int] | None = None, parts: list[Part] | None = None) -> None:
        """Consecutive row blocks of `dst` (a fused q/k/v or gate/up weight or bias) from several
        tensors (or their `parts`), `rows[i]` rows each (default: equal parts)."""
        rows = rows or [dst.shape[0] // len(names)] * len(names)
        start = 0
        for i, (name, n) in enumerate(zip(names, rows, strict=True)):
            self.copy(dst[start : start + n], name, rope_heads[i] if rope_heads else 0, parts[i] if parts else None)
            start += n

    def mlp(self, mlp: MLP, prefix: str, names: tuple[str, str, str], bias: bool = False,
            shard: Shard = ONE) -> None:
        """Tensor parallel: gate and up rows, and down columns, of this rank's `mlp.columns`."""
        gate, up, down = (prefix + n for n in names)
        cols = mlp.columns
        inter, hidden = len(cols) * shard.size, mlp.gate_up.weight.shape[1]
        if shard.parallel:
            rows_part = Part((inter, hidden), rows=cols)
            self.linear(mlp.gate_up, [f"{gate}.weight", f"{up}.weight"], parts=[rows_part, rows_part])
            self.linear(mlp.down, [down + ".weight"], parts=[Part((hidden, inter), cols=cols)])
        else:
            self.linear(mlp.gate_up, [f"{gate}.weight", f"{up}.weight"])
            self.linear(mlp.down, [down + ".weight"])
        if bias:
            assert mlp.gate_up.bias is not None
            self.fused(mlp.gate_up.bias, [f"{gate}.bias", f"{up}.bias"],
                       parts=[Part((inter,), rows=cols)] * 2 if shard.parallel else None)
            if mlp.down.bias is not None:
                self.copy(mlp.down.bias, down + ".bias")
            else:  # (row-parallel: the bias is added once, on rank 0)
                self.ckpt.skip(down + ".bias")


def _pad_rows(qw: quant.QuantizedWeight, rows: int) -> quant.QuantizedWeight:
    """`qw` with zero rows appended up to `rows` (the last rank's share past the vocabulary)."""
    extra = rows - qw.shape[0]
    if extra <= 0:
        return qw

    def pad(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x.new_zeros(extra, *x.shape[1:])])

    return quant.QuantizedWeight(qw.kind, pad(qw.q), pad(qw.scales), None if qw.mins is None else pad(qw.mins),
                                 qw.group_size)


def load_model(model_dir: str | Path, device: torch.device, dtype: torch.dtype,
               quantization: str | None = None, staging: Staging | Literal[False] | None = None,
               shard: Shard = ONE, stage: Stage = WHOLE, compress_weights: bool = False) -> DecoderModel:
    """`quantization` (int8 | int4) quantizes a float checkpoint's matmul weights after loading; a
    checkpoint stored quantized (`engine.model.quant`'s layout, e.g. a converted GGUF) stays as stored.
    Loads to a device go through pinned `staging` buffers (made here unless given; False: through
    pageable temporaries, the benchmark's baseline); a CPU load reads straight into its parameters
    unless a `Staging` is given. `shard`: a tensor-parallel rank's part only (`parallel.py`), read as
    slices of the checkpoint's tensors; `stage`: a pipeline stage's layers only (the rest not read).
    `compress_weights`: bfloat16 matmul weights kept losslessly compressed (`DecoderModel.compress_weights`)."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    cached = weight_cache.cache_path(model_dir, dtype, quantization, shard, stage) if (
        device.type == "cpu" and weight_cache.enabled(model_dir)) else None
    if cached is not None and cached.is_file():
        model = _allocate(cfg, device, dtype, shard, stage)
        try:
            model.weight_mapping = weight_cache.restore(model, cached)
        except (ModelLoadError, OSError, ValueError, RuntimeError, KeyError, TypeError) as e:
            log.warning("event=weight_cache_unusable path=%s error=%s (loading the checkpoint, rewriting it)", cached, e)
            cached.unlink(missing_ok=True)
        else:
            release = weight_cache.PageRelease(model.weight_mapping)
            model = _finish(model, device, release, compress_weights)
            log.info("event=weights_mapped path=%s released_mib=%.0f", cached, release.released / 2**20)
            return model
    if staging is None and device.type != "cpu":
        staging = Staging(device)
    staging = staging or None
    ckpt = Checkpoint(model_dir, staging)
    model = _allocate(cfg, device, dtype, shard, stage)
    with torch.no_grad():
        _read_tensors(model, ckpt, cfg, model_dir, shard, stage)
        if quantization is not None:
            model.quantize(quantization)
    ckpt.close()
    if staging is not None:
        staging.finish()
        log.info("event=weights_staged tensors=%d chunks=%d mib=%.0f", staging.uploads, staging.chunks,
                 staging.bytes / 2**20)
    unread = sorted(n for n in ckpt.unread if not n.endswith(_INERT_SUFFIXES)
                    and not (cfg.checkpoint_prefix and n.startswith(VISION_PREFIXES)))
    if unread:
        raise ModelLoadError(f"{model_dir}: {len(unread)} checkpoint tensor(s) the config does not account for, "
                             f"e.g. {unread[:4]} (a config field splitfire did not read, or the wrong config.json?)")
    if cached is not None:
        t0 = time.perf_counter()
        try:
            weight_cache.save(model, cached)
            log.info("event=weight_cache_written path=%s mb=%.0f seconds=%.2f", cached, cached.stat().st_size / 2**20,
                     time.perf_counter() - t0)
        except OSError as e:  # (a read-only or full cache directory: serve anyway)
            log.warning("event=weight_cache_not_written path=%s error=%s", cached, e)
    return _finish(model, device, None, compress_weights)


def _read_tensors(model: DecoderModel, ckpt: Checkpoint, cfg: ModelConfig, model_dir: Path, shard: Shard,
                  stage: Stage) -> None:
    """Every tensor this rank and stage hold, read into `model`: the embedding (or its vocabulary slice), the
    final norm, the LM head (unless tied or another stage's), each layer; the others skipped by name."""
    load = _Loader(ckpt, cfg.fp8_weight_block)
    root, head = _text_model_prefixes(ckpt, cfg)
    # Tensor parallel: the embedding's and LM head's rows of this rank's slice of the vocabulary.
    vocab = Part((cfg.vocab_size, cfg.hidden_size), rows=model.vocab_rows) if shard.parallel else None
    embed = root + "embed_tokens.weight"
    if not model.embed.weight.numel():  # (a pipeline stage that neither embeds nor ties the head to it)
        for suffix in ("", *quant.SUFFIXES):
            ckpt.skip(embed + suffix)
    elif load.is_quantized(embed):
        qw = (load.as_quantized(embed, tuple(model.embed.weight.shape), part=vocab) if vocab is not None
              else load.quantized(embed, tuple(model.embed.weight.shape)))
        model.set_embedding_quantized(qw.to(model.embed.weight.device))
    else:
        load.copy(model.embed.weight, embed, part=vocab)
    load.norm(model.norm, root + "norm.weight")
    if cfg.tie_word_embeddings or not stage.last:
        ckpt.skip(head)  # some tied checkpoints store a copy; the embedding is what runs
        for suffix in quant.SUFFIXES:
            ckpt.skip(head + suffix)
    else:
        load.linear(model.lm_head, [head if ckpt.has(head) or ckpt.has(head + ".qweight") else embed],
                    parts=[vocab] if vocab is not None else None)
    for i, layer in zip(model.layer_ids, tqdm(model.layers, desc=f"loading {model_dir.name}", unit="layer",
                                              disable=None), strict=True):
        _load_block(load, cfg, layer, f"{root}layers.{i}.", shard)
    others = tuple(f"{root}layers.{i}." for i in range(cfg.num_layers) if i not in model.layer_ids)
    for name in [n for n in ckpt.unread if n.startswith(others)] if others else []:
        ckpt.skip(name)  # (another pipeline stage's layers)
    _skip_mtp_layers(ckpt, cfg, root)


def _finish(model: DecoderModel, device: torch.device, dropped: Callable[[torch.Tensor], None] | None = None,
            compress_weights: bool = False) -> DecoderModel:
    model.eval()
    if compress_weights:  # (before CPU packing, which lets the bfloat16 weights go)
        saved = model.compress_weights()
        log.info("event=weights_compressed saved_mib=%.1f", saved / 2**20)
    if device.type == "cpu":
        model.optimize_for_cpu(dropped)
        _return_freed_heap()
    return model


def _skip_mtp_layers(ckpt: Checkpoint, cfg: ModelConfig, root: str) -> None:
    """DeepSeek-V3 checkpoints append their multi-token-prediction module as layers past
    `num_hidden_layers` (`model.layers.61.*`); it only drafts tokens, and is not loaded."""
    if cfg.mla is None:
        return
    extra = [n for n in ckpt.unread if n.startswith(f"{root}layers.")
             and int(n[len(root) + 7 :].split(".", 1)[0]) >= cfg.num_layers]
    for name in extra:
        ckpt.skip(name)
    if extra:
        log.info("skipped %d tensors of the multi-token-prediction layers (not used for decoding)", len(extra))


def _return_freed_heap() -> None:
    """Give the heap pages freed by packing (or, on a mapped load, by the replaced placeholder
    parameters) back to the OS: glibc keeps them otherwise (measured +12 MiB resident for a 50 MiB
    model; +13 MiB peak for SmolLM2's mapped start without it)."""
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


def _allocate(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, shard: Shard = ONE,
              stage: Stage = WHOLE) -> DecoderModel:
    """The model's parameters, uninitialised, made directly on `device` in `dtype` (no module runs a
    random init; building on "meta" and moving would touch every page twice)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return DecoderModel(cfg, shard, stage)
    finally:
        torch.set_default_dtype(default)


def _load_block(load: _Loader, cfg: ModelConfig, layer: Block, p: str, shard: Shard = ONE) -> None:
    load.norm(layer.attn_norm, p + "input_layernorm.weight")
    if cfg.sandwich_norm:
        load.norm(layer.attn_post_norm, p + "post_attention_layernorm.weight")
        load.norm(layer.mlp_norm, p + "pre_feedforward_layernorm.weight")
        load.norm(layer.mlp_post_norm, p + "post_feedforward_layernorm.weight")
    else:
        load.norm(layer.mlp_norm, p + "post_attention_layernorm.weight")

    if isinstance(layer.attn, MLAttention):
        _load_mla(load, cfg, layer.attn, p + "self_attn.", shard)
    else:
        _load_attention(load, cfg, layer, p, shard)
    if isinstance(layer.mlp, MoE):
        _load_moe(load, cfg, layer.mlp, p, shard)
    else:
        assert isinstance(layer.mlp, MLP)
        load.mlp(layer.mlp, p + "mlp.", ("gate_proj", "up_proj", "down_proj"), bias=cfg.mlp_bias, shard=shard)


def _load_attention(load: _Loader, cfg: ModelConfig, layer: Block, p: str, shard: Shard = ONE) -> None:
    """Tensor parallel: the q rows of this rank's heads and the k/v rows of their KV heads; o's columns
    of its heads."""
    a, d, hidden = layer.attn, cfg.head_dim, cfg.hidden_size
    assert isinstance(a, Attention)
    h, kvh = a.num_heads, a.num_kv_heads  # (this rank's)
    names = [f"{p}self_attn.{n}_proj" for n in "qkv"]
    q_rows = range(a.q_heads.start * d, a.q_heads.stop * d)
    kv_rows = range(a.kv_heads.start * d, a.kv_heads.stop * d)
    q_full, kv_full = cfg.num_heads * d, cfg.num_kv_heads * d
    parts = ([Part((q_full, hidden), q_rows), Part((kv_full, hidden), kv_rows), Part((kv_full, hidden), kv_rows)]
             if shard.parallel else None)
    load.linear(a.qkv, [n + ".weight" for n in names], list(a.split), rope_heads=[h, kvh, 0], parts=parts)
    if cfg.qkv_bias:
        assert a.qkv.bias is not None
        bias_parts = ([Part((q_full,), q_rows), Part((kv_full,), kv_rows), Part((kv_full,), kv_rows)]
                      if shard.parallel else None)
        load.fused(a.qkv.bias, [n + ".bias" for n in names], list(a.split), rope_heads=[h, kvh, 0], parts=bias_parts)
    load.linear(a.o, [p + "self_attn.o_proj.weight"],
                parts=[Part((hidden, q_full), cols=q_rows)] if shard.parallel else None)
    if cfg.o_bias:
        if a.o.bias is not None:
            load.copy(a.o.bias, p + "self_attn.o_proj.bias")
        else:  # (row-parallel: the bias is added once, on rank 0)
            load.ckpt.skip(p + "self_attn.o_proj.bias")
    if cfg.qk_norm:
        load.norm(a.q_norm, p + "self_attn.q_norm.weight", rope_interleaved=True)
        load.norm(a.k_norm, p + "self_attn.k_norm.weight", rope_interleaved=True)


def _load_mla(load: _Loader, cfg: ModelConfig, a: MLAttention, p: str, shard: Shard = ONE) -> None:
    """q_a (or q) and kv_a_proj_with_mqa fused into one matmul; RoPE rows reordered to interleaved pairs
    unless the checkpoint has them so (`rope_interleave`). Tensor parallel: this rank's heads' rows of a
    plain q projection, q_b and kv_b, and their columns of o; q_a and kv_a whole."""
    m = cfg.mla
    assert m is not None
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    half_split = not m.rope_interleaved
    heads, hidden = a.head_range, cfg.hidden_size

    def head_rows(per_head: int) -> range:
        return range(heads.start * per_head, heads.stop * per_head)

    q_name = p + ("q_a_proj.weight" if m.q_lora_rank else "q_proj.weight")
    kv_name = p + "kv_a_proj_with_mqa.weight"
    kv_rows = m.kv_lora_rank + m.qk_rope_head_dim
    parts = None
    if shard.parallel:
        q_part = (Part((m.q_lora_rank, hidden)) if m.q_lora_rank
                  else Part((cfg.num_heads * qk, hidden), rows=head_rows(qk)))
        parts = [q_part, Part((kv_rows, hidden))]
    load.linear(a.qkv_a, [q_name, kv_name], [a.q_rows, kv_rows], parts=parts)
    if half_split:
        # q_a's rows hold no RoPE dims; a plain q projection's do, per head, as q_b's.
        q_rows = torch.arange(a.q_rows) if m.q_lora_rank else rope_rows_perm(a.heads, qk, m.qk_rope_head_dim)
        kv_perm = a.q_rows + rope_rows_perm(1, kv_rows, m.qk_rope_head_dim)
        _permute_rows(a.qkv_a, torch.cat((q_rows, kv_perm)), p)
    if a.q_b is not None:
        load.norm(a.q_a_norm, p + "q_a_layernorm.weight")
        load.linear(a.q_b, [p + "q_b_proj.weight"],
                    parts=[Part((cfg.num_heads * qk, m.q_lora_rank), rows=head_rows(qk))] if shard.parallel else None)
        if half_split:
            _permute_rows(a.q_b, rope_rows_perm(a.heads, qk, m.qk_rope_head_dim), p)
    load.norm(a.kv_a_norm, p + "kv_a_layernorm.weight")
    per_head = m.qk_nope_head_dim + m.v_head_dim
    load.copy(a.kv_b, p + "kv_b_proj.weight",
              part=Part((cfg.num_heads * per_head, m.kv_lora_rank), rows=head_rows(per_head)) if shard.parallel else None)
    load.linear(a.o, [p + "o_proj.weight"],
                parts=[Part((hidden, cfg.num_heads * m.v_head_dim), cols=head_rows(m.v_head_dim))]
                if shard.parallel else None)


def rope_rows_perm(heads: int, head_rows: int, rope: int) -> torch.Tensor:
    """Row order that turns each head's trailing `rope` rows from half-split to interleaved pairs."""
    per_head = torch.cat((torch.arange(head_rows - rope), head_rows - rope + interleave_rope_rows(torch.arange(rope), 1)))
    return (torch.arange(heads)[:, None] * head_rows + per_head).flatten()


def _permute_rows(lin: Linear, rows: torch.Tensor, p: str) -> None:
    """Reorder `lin`'s output rows (quantized: codes and scales alike — each row's quantization lives in
    its own row; row blocks in different formats each within themselves)."""
    if lin.quantized is None:
        lin.weight.copy_(lin.weight[rows])
        return
    out, start = [], 0
    for part in lin.quantized:
        n = part.shape[0]
        own = rows[start : start + n] - start
        if not torch.equal(own.sort().values, torch.arange(n)):
            raise ModelLoadError(f"{p}: a row order across weights stored in different formats")
        out.append(part.map_rows(lambda t, own=own: t[own.to(t.device)]))
        start += n
    lin.quantized = out


def _load_moe(load: _Loader, cfg: ModelConfig, moe: MoE, p: str, shard: Shard = ONE) -> None:
    """Experts as checkpoints store them: one tensor per expert and projection (Qwen: gate/up/down_proj,
    Mixtral: w1/w3/w2 under block_sparse_moe), or already stacked (`experts.gate_up_proj` [E, 2I, H],
    `experts.down_proj` [E, H, I], as transformers 5 holds them in memory). Tensor parallel: this rank's
    experts (`moe.local`, expert parallel) or every expert's slice of the intermediate size (`moe.columns`)."""
    ckpt = load.ckpt
    mixtral = ckpt.has(p + "block_sparse_moe.gate.weight")
    prefix = p + ("block_sparse_moe." if mixtral else "mlp.")
    load.copy(moe.router.weight, prefix + "gate.weight")
    ex = moe.experts
    hidden, inter = cfg.hidden_size, moe.cfg.intermediate_size
    cols = moe.columns
    split = len(cols) < inter  # (each expert's intermediate size split across the ranks)
    if ckpt.has(prefix + "experts.gate_up_proj"):
        if not shard.parallel:
            load.copy(ex.gate_up, prefix + "experts.gate_up_proj")
            load.copy(ex.down, prefix + "experts.down_proj")
        else:  # (stacked: read whole, this rank's experts / columns kept)
            gu, dn = ckpt.get(prefix + "experts.gate_up_proj"), ckpt.get(prefix + "experts.down_proj")
            local = slice(moe.local.start, moe.local.stop)
            gu, dn = gu[local], dn[local]
            ex.gate_up.copy_(torch.cat([gu[:, cols.start : cols.stop], gu[:, inter + cols.start : inter + cols.stop]], 1))
            ex.down.copy_(dn[:, :, cols.start : cols.stop])
    else:
        gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        names = [tuple(f"{prefix}experts.{e}.{n}.weight" for n in (gate, up, down)) for e in moe.local]
        rows_part = Part((inter, hidden), rows=cols) if split else None
        down_part = Part((hidden, inter), cols=cols) if split else None
        for e in range(moe.cfg.num_experts):  # another rank's experts: deliberately not read here
            if e not in moe.local:
                for n in (gate, up, down):
                    for suffix in ("", *quant.SUFFIXES):
                        ckpt.skip(f"{prefix}experts.{e}.{n}.weight{suffix}")
        if any(load.is_quantized(n) for trio in names for n in trio):
            # Stored quantized (a converted GGUF): kept quantized, expert by expert.
            local_inter = len(cols)
            gate_up = []
            for g, u, _ in names:
                parts = [load.as_quantized(g, (local_inter, hidden), part=rows_part),
                         load.as_quantized(u, (local_inter, hidden), part=rows_part)]
                merged = quant.concat_rows(parts)
                if merged is None:  # gate and up in different formats: one int8 weight for both
                    w = torch.cat([p.dequantize() for p in parts])
                    merged = quant.quantize(w, "int8", quant.group_size_for(hidden, "int8"))
                gate_up.append(merged)
            ex.set_quantized(gate_up, [load.as_quantized(d, (hidden, local_inter), part=down_part) for _, _, d in names])
        else:
            for e, (g, u, d) in enumerate(names):
                load.fused(ex.gate_up[e], [g, u], parts=[rows_part, rows_part] if split else None)
                load.copy(ex.down[e], d, part=down_part)
    if moe.score_bias is not None:
        load.copy(moe.score_bias, prefix + "gate.e_score_correction_bias")
    if moe.shared is not None:
        # Qwen2-MoE: one gated shared expert; DeepSeek-V3: `n_shared_experts` fused into one MLP, ungated.
        load.mlp(moe.shared, prefix + ("shared_expert." if moe.shared_gate is not None else "shared_experts."),
                 ("gate_proj", "up_proj", "down_proj"), shard=shard)
    if moe.shared_gate is not None:
        load.copy(moe.shared_gate.weight, prefix + "shared_expert_gate.weight")
