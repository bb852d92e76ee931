"""Sizing a deployment from a model's `config.json` alone (`splitfire plan`): per device, the weight
bytes, the reserve for activations and CUDA graphs, KV bytes per token, how many KV tokens fit, the
bytes moved between devices per decode step, a roofline step time, and the smallest layout that fits.

The model is read generically (dense, mixture-of-experts, DeepSeek's latent attention); nothing is
loaded. Layouts follow `engine/model/parallel.py`: tensor parallel splits attention heads, MLPs and
the vocabulary over `tp` devices (KV heads split, or replicated when fewer than `tp`; a latent cache
is replicated on every TP rank, since each rank's heads read all of it); pipeline parallel splits the
layers into `pp` stages; expert parallel places whole experts on devices instead of splitting each.
Torch-free: the router, the planner and the fleet simulator import it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GiB = 2**30
CONFIGS = Path(__file__).with_name("configs")  # built-in names: published configs' relevant fields


@dataclass(frozen=True)
class Device:
    name: str
    memory: int  # bytes, as the driver reports them
    hbm: float  # bytes/s of device memory bandwidth
    link: float  # bytes/s one way between two devices of a node (NVLink)


DEVICES = {
    "h100-80gb": Device("H100 80GB SXM", 81559 * 2**20, 3.35e12, 450e9),
    "h200": Device("H200 141GB SXM", 143771 * 2**20, 4.8e12, 450e9),
    "a100-80gb": Device("A100 80GB SXM", 81920 * 2**20, 2.04e12, 300e9),
    "l40s": Device("L40S 48GB", 46068 * 2**20, 0.864e12, 32e9),  # (no NVLink: PCIe 4.0 x16)
}
# Bytes per weight as the engine holds them (engine/model/quant.py): float formats; FP8 (one byte, and the
# checkpoint's block scales kept per row: a float32 per 128 weights); weight-only int8/int4 (a float32 scale
# per 128 / 32 weights, and an int4 minimum).
WEIGHT_BYTES = {"bfloat16": 2.0, "float16": 2.0, "float32": 4.0, "fp8": 1.0 + 4 / 128,
                "int8": 1.0 + 4 / 128, "int4": 0.5 + 8 / 32}
# The embedding and LM head under each weight format: FP8 checkpoints (and --quantization fp8) keep them in
# the model dtype, int4 keeps them at int8 (a 4-bit head costs perplexity), others as the matmuls.
ENDS_FORMAT = {"fp8": None, "int4": "int8"}
KV_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1}
# `--compress-weights`: bfloat16 matmul weights held in device memory at this share of their bytes (a 4-bit
# exponent code + the sign/mantissa byte + rare escapes: 0.752-0.755 measured over normal-init and SmolLM2
# matrices, `python -m loadtest.bench_engine --compression`). Every matrix: attention, MLPs, stacked experts,
# routers, the embedding and an untied LM head.
COMPRESSED_RATIO = 0.755
# ... and, from 33 rows (a prefill chunk), each matrix is decoded to bfloat16 at most this many bytes at a time
# for the vendor GEMM (`engine/model/kernels/compressed_triton.py` takes its DECOMPRESS_CHUNK from here): a
# transient buffer the activation reserve holds too.
DECOMPRESS_BUFFER_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Model:
    """The architecture facts sizing needs."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP (and the dense layers of a mixture-of-experts model)
    vocab: int
    tied: bool
    max_len: int
    experts: int = 0  # routed experts per MoE layer (0: dense)
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0  # the always-on shared expert(s), summed
    shared_gate: bool = False  # Qwen2-MoE: the shared expert's output is gated (a [hidden -> 1] linear)
    moe_layers: int = 0
    kv_lora_rank: int = 0  # latent attention (MLA): the cached latent's width, plus its RoPE key
    rope_dim: int = 0
    q_lora_rank: int = 0
    nope_dim: int = 0
    v_dim: int = 0
    dtype: str = "bfloat16"  # as published
    published_quantization: str | None = None  # fp8 when the checkpoint ships FP8 weights

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    def attention_params(self) -> tuple[int, int]:
        """(split across TP ranks, replicated on each) parameters of one layer's attention."""
        h, d = self.hidden, self.head_dim
        if not self.mla:
            return h * self.heads * d * 2 + 2 * h * self.kv_heads * d, 0
        qk = self.nope_dim + self.rope_dim
        q = (self.q_lora_rank * self.heads * qk) if self.q_lora_rank else h * self.heads * qk
        replicated = h * (self.kv_lora_rank + self.rope_dim) + (h * self.q_lora_rank if self.q_lora_rank else 0)
        split = q + self.kv_lora_rank * self.heads * (self.nope_dim + self.v_dim) + self.heads * self.v_dim * h
        return split, replicated

    def params(self) -> dict[str, int]:
        """Parameters by part (the whole model)."""
        split, rep = self.attention_params()
        dense_layers = self.layers - self.moe_layers
        out = {"embedding": self.vocab * self.hidden * (1 if self.tied else 2), "attention": self.layers * (split + rep),
               "dense_mlp": dense_layers * 3 * self.hidden * self.intermediate}
        if self.experts:
            out["experts"] = self.moe_layers * self.experts * 3 * self.hidden * self.expert_intermediate
            out["shared_experts"] = self.moe_layers * 3 * self.hidden * self.shared_intermediate
            out["routers"] = self.moe_layers * self.hidden * (self.experts + (1 if self.shared_gate else 0))
        return out

    def active_params(self) -> int:
        """Parameters one token reads (its top-k experts of each MoE layer)."""
        p = self.params()
        if not self.experts:
            return sum(p.values())
        return sum(p.values()) - p["experts"] + p["experts"] * self.experts_per_token // self.experts


def _moe_layers(cfg: dict[str, Any], layers: int) -> int:
    if "first_k_dense_replace" in cfg:
        return layers - int(cfg["first_k_dense_replace"])
    step = cfg.get("interleave_moe_layer_step") or cfg.get("decoder_sparse_step") or 1
    dense_only = set(cfg.get("mlp_only_layers") or [])
    return sum(1 for i in range(layers) if (i + 1) % step == 0 and i not in dense_only)


def read_model(name_or_dir: str) -> Model:
    """A model from a directory's (or a built-in name's) config.json. Raises ValueError naming what is
    missing."""
    path = Path(name_or_dir)
    if path.is_dir():
        path = path / "config.json"
    elif not path.is_file():
        path = CONFIGS / f"{name_or_dir}.json"
    if not path.is_file():
        known = sorted(p.stem for p in CONFIGS.glob("*.json"))
        raise ValueError(f"no config.json at {name_or_dir!r}, and it is not a built-in name ({', '.join(known)})")
    raw = json.loads(path.read_text())
    cfg = raw.get("text_config") or raw
    try:
        hidden, layers, heads = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
        vocab = cfg["vocab_size"]
    except KeyError as e:
        raise ValueError(f"{path}: no {e.args[0]!r}: not a decoder config splitfire plan can read") from e
    experts = cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    expert_inter = cfg.get("moe_intermediate_size") or (cfg.get("intermediate_size", 0) if experts else 0)
    dense_inter = cfg.get("intermediate_size_mlp") or cfg.get("intermediate_size", 0)
    shared = (cfg.get("n_shared_experts") or 0) * expert_inter or cfg.get("shared_expert_intermediate_size") or 0
    if experts and raw.get("model_type") == "llama4":
        shared = cfg.get("intermediate_size", 0)  # Llama 4: one shared expert as wide as a routed one
    quant = (raw.get("quantization_config") or {}).get("quant_method")
    return Model(
        name=path.parent.name if path.name == "config.json" else path.stem, hidden=hidden, layers=layers,
        heads=heads, kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or (cfg.get("v_head_dim") if cfg.get("kv_lora_rank") else hidden // heads),
        intermediate=dense_inter, vocab=vocab, tied=bool(cfg.get("tie_word_embeddings", False)),
        max_len=cfg.get("max_position_embeddings", 4096), experts=experts,
        experts_per_token=cfg.get("num_experts_per_tok", 0), expert_intermediate=expert_inter if experts else 0,
        shared_intermediate=shared if experts else 0,
        shared_gate=bool(experts and cfg.get("shared_expert_intermediate_size")), moe_layers=_moe_layers(cfg, layers) if experts else 0,
        kv_lora_rank=cfg.get("kv_lora_rank") or 0, rope_dim=cfg.get("qk_rope_head_dim") or 0,
        q_lora_rank=cfg.get("q_lora_rank") or 0, nope_dim=cfg.get("qk_nope_head_dim") or 0,
        v_dim=cfg.get("v_head_dim") or 0, dtype=str(cfg.get("torch_dtype") or raw.get("torch_dtype") or "bfloat16"),
        published_quantization="fp8" if quant == "fp8" else None)


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    ep: bool = False  # experts placed whole over the tp devices of a stage

    @property
    def devices(self) -> int:
        return self.tp * self.pp

    def __str__(self) -> str:
        return f"TP{self.tp} x PP{self.pp}{' + EP' if self.ep else ''} ({self.devices} devices)"


@dataclass(frozen=True)
class Plan:
    model: Model
    device: Device
    layout: Layout
    weight_format: str
    kv_format: str
    weight_bytes: int  # per device (the most loaded stage: the first or last, with the embedding / head)
    reserve_bytes: int
    kv_bytes_per_token: int  # per device
    kv_tokens: int  # per device (a request's KV is on every device of its TP group)
    comm_bytes_per_token: int  # bytes one device sends per decode token (all-reduces, all-to-alls, stage hops)
    step_ms_b1: float  # decode step at batch 1: weights + KV read at HBM speed, plus the collectives
    step_ms_b64: float

    @property
    def fits(self) -> bool:
        return self.kv_tokens > 0

    @property
    def kv_gib(self) -> float:
        return self.kv_tokens * self.kv_bytes_per_token / GiB


USABLE = 0.92  # of device memory: the CUDA context, NCCL and allocator fragmentation take the rest


def plan(model: Model, device: Device, layout: Layout, quantization: str | None = None,
         kv_cache_dtype: str | None = None, chunk_tokens: int = 8192, context: int = 4096,
         compress_weights: bool = False) -> Plan:
    """One layout's numbers. `quantization`: the weight format (default: as published: FP8 checkpoints
    in FP8, else the model dtype); `chunk_tokens`: the largest prefill chunk (sizes the activation
    reserve); `context`: tokens of context per sequence for the roofline step times; `compress_weights`:
    bfloat16 matmul weights held compressed (`COMPRESSED_RATIO`)."""
    tp, pp = layout.tp, layout.pp
    wfmt = quantization or model.published_quantization or model.dtype
    if compress_weights and wfmt != "bfloat16":
        raise ValueError(f"--compress-weights applies to bfloat16 weights, not {wfmt}")
    kfmt = kv_cache_dtype or ("bfloat16" if model.dtype in ("float32", "bfloat16") else model.dtype)
    wb, kb = WEIGHT_BYTES[wfmt], KV_BYTES[kfmt]
    per_stage = math.ceil(model.layers / pp)
    moe_share = model.moe_layers / model.layers if model.layers else 0.0
    moe_per_stage, dense_per_stage = per_stage * moe_share, per_stage * (1 - moe_share)
    split, rep = model.attention_params()
    attn = per_stage * (split / tp + rep)
    dense = dense_per_stage * 3 * model.hidden * model.intermediate / tp
    experts = 0.0
    if model.experts:
        per_expert = 3 * model.hidden * model.expert_intermediate
        # EP: whole experts over the stage's devices; otherwise every expert split across them.
        experts = moe_per_stage * (model.experts * per_expert / tp)
        experts += moe_per_stage * (3 * model.hidden * model.shared_intermediate / tp + model.hidden * model.experts)
    embed = model.vocab * model.hidden / tp  # vocab-parallel; the first stage holds the embedding,
    head = 0 if model.tied else embed  # the last the LM head (the heavier of the two ends is sized)
    ends = embed + head if pp == 1 else max(embed, head)
    squeezed = COMPRESSED_RATIO if compress_weights else 1.0
    efmt = ENDS_FORMAT.get(wfmt, wfmt) or ("bfloat16" if model.dtype == "float32" else model.dtype)
    weights = int((attn + dense + experts) * squeezed * wb + ends * squeezed * WEIGHT_BYTES[efmt])
    if compress_weights:
        wfmt = "bfloat16, matmuls compressed in memory"
    # Activations: the largest prefill chunk's hidden states and MLP intermediates (a few copies),
    # its logits rows (sampled rows only), plus CUDA graphs' pool and NCCL buffers.
    width = max(model.hidden * 4, 2 * max(model.intermediate, model.expert_intermediate * max(model.experts_per_token, 1)) // tp)
    reserve = int(chunk_tokens * width * 2 * 2 + 2 * GiB) + (DECOMPRESS_BUFFER_BYTES if compress_weights else 0)
    if model.mla:
        kv_per_token = per_stage * (model.kv_lora_rank + model.rope_dim) * kb  # replicated on each TP rank
    else:
        kv_per_token = per_stage * 2 * math.ceil(model.kv_heads / tp) * model.head_dim * kb
    free = int(device.memory * USABLE) - weights - reserve
    kv_tokens = max(free, 0) // kv_per_token
    # Per decode token, bytes one device sends: a ring all-reduce of the hidden state after attention
    # and after the MLP (2(n-1)/n of it each), an EP dispatch + combine of top-k hidden states, and
    # the hidden state handed to the next stage.
    hid = model.hidden * 2  # bfloat16 activations
    comm = per_stage * 2 * hid * 2 * (tp - 1) / tp if tp > 1 else 0.0
    if layout.ep and model.experts:
        comm += moe_per_stage * 2 * model.experts_per_token * hid * (tp - 1) / tp
    comm += hid if pp > 1 else 0
    return Plan(model, device, layout, wfmt, kfmt, weights, reserve, int(kv_per_token), int(kv_tokens), int(comm),
                _step_ms(model, device, layout, wb, kv_per_token, comm, 1, context, squeezed),
                _step_ms(model, device, layout, wb, kv_per_token, comm, 64, context, squeezed))


def _step_ms(model: Model, device: Device, layout: Layout, wb: float, kv_per_token: float, comm: float,
             batch: int, context: int, squeezed: float = 1.0) -> float:
    """Decode step time at `batch` as a roofline on one stage: the weights a step reads (a MoE layer reads
    the experts its tokens chose: E(1 - (1 - k/E)^batch) of them) and the batch's KV at HBM speed, plus
    the collectives at link speed. Pipeline stages run one after another for one micro-batch. `squeezed`:
    the share of their bytes the weights are read at (`--compress-weights`: every matrix)."""
    p = model.params()
    read = float(sum(p.values()))
    if model.experts:
        touched = model.experts * (1 - (1 - model.experts_per_token / model.experts) ** batch)
        read = read - p["experts"] + p["experts"] * touched / model.experts
    read *= squeezed
    per_device = read * wb / layout.devices
    kv = batch * context * kv_per_token
    t = (per_device + kv) / device.hbm + batch * comm / device.link if layout.devices > 1 else (per_device + kv) / device.hbm
    return t * layout.pp * 1e3


def smallest(model: Model, device: Device, quantization: str | None = None, kv_cache_dtype: str | None = None,
             min_kv_tokens: int = 32768, max_devices: int = 64) -> Plan | None:
    """The layout with the fewest devices whose KV cache holds at least `min_kv_tokens` per device
    (ties: more tensor parallel first, expert parallel for MoE models)."""
    best: Plan | None = None
    for devices in (1, 2, 4, 8, 16, 32, 64):
        if devices > max_devices:
            break
        for tp in (8, 4, 2, 1):
            if devices % tp or devices // tp > 64:
                continue
            for ep in ((True, False) if model.experts else (False,)):
                p = plan(model, device, Layout(tp, devices // tp, ep), quantization, kv_cache_dtype)
                if p.kv_tokens >= min_kv_tokens and (best is None or p.kv_tokens > best.kv_tokens):
                    best = p
        if best is not None:
            return best
    return None


def render(p: Plan) -> str:
    m = p.model
    params = sum(m.params().values())
    rows = [
        f"model {m.name}: {params / 1e9:.1f}B parameters ({m.active_params() / 1e9:.1f}B active per token), "
        f"{m.layers} layers{', latent attention' if m.mla else ''}"
        f"{f', {m.experts} experts (top {m.experts_per_token})' if m.experts else ''}",
        f"device {p.device.name}, layout {p.layout}, weights {p.weight_format}, KV cache {p.kv_format}",
        f"  weight bytes per device       {p.weight_bytes / GiB:10.1f} GiB",
        f"  reserve (activations, graphs) {p.reserve_bytes / GiB:10.1f} GiB",
        f"  KV bytes per token per device {p.kv_bytes_per_token:10,d} B",
        f"  KV tokens that fit            {p.kv_tokens:10,d}  ({p.kv_gib:.1f} GiB)" if p.fits else
        f"  KV tokens that fit            {'none':>10}  (weights + reserve exceed the device by "
        f"{(p.weight_bytes + p.reserve_bytes - p.device.memory * USABLE) / GiB:.1f} GiB)",
        f"  sent per decode token         {p.comm_bytes_per_token:10,d} B per device",
        f"  roofline decode step          {p.step_ms_b1:10.2f} ms at batch 1, {p.step_ms_b64:.2f} ms at batch 64",
    ]
    return "\n".join(rows)
