"""A CPU decode step's decoder layers in one C call (`sf_decode_layers` in kernels/cpu_ops.c).

At batch 1 the per-layer work is small (SmolLM2: ~60 us of quantized matmuls per layer), so the
Python between the kernels — ~13 module calls, views and ctypes calls per layer — cost ~4 ms of a
16 ms step (measured with cProfile). This runs the same kernels, with the same arguments and in
the same order as `model.Block.forward` does on a decode step, from one C loop: the result is
bit-identical (tested), only the Python is gone. Rows of short chunks — speculative verifications,
small prompt chunks — go through the same decode attention, one query per row over the keys up to
its position (the module path runs those through SDPA: equal up to float rounding).

It applies to plain pre-norm decoders whose every matmul weight is quantized (a GGUF served as
stored, a block-FP8 checkpoint, or `--quantization int8|int4|fp8`), in float32 with a float32, float16 or e4m3 KV cache: Llama,
Mistral, Qwen2, SmolLM2, for steps of up to 64 rows. Everything else — q/k norms, latent attention, experts,
Gemma's norms, float weights, longer steps — takes the module path.
"""

from __future__ import annotations

import ctypes

import torch

from engine.model import quant
from engine.model.attention import AttentionMetadata
from engine.model.kernels import cpu_ops
from engine.model.kv_cache import KVCache
from engine.model.layers import MLP, Linear
from engine.model.model_config import ModelConfig

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
KINDS = {"int8": 0, "int4": 1, "fp8": 2}  # SfLinear.kind (cpu_ops.c KIND_*)


class SfLinear(ctypes.Structure):
    _fields_ = [("q", _P), ("s", _P), ("mn", _P), ("bias", _P), ("n", _I), ("k", _I), ("gs", _I), ("kind", _I),
                ("q8x", _I), ("la", _P), ("lb", _P), ("lr", _I), ("lhalf", _I)]


class SfLayer(ctypes.Structure):
    _fields_ = [("attn_norm", _P), ("mlp_norm", _P), ("qkv", SfLinear), ("o", SfLinear), ("gate_up", SfLinear),
                ("down", SfLinear), ("cache", _P), ("window", _I), ("rope", _I)]


class SfDims(ctypes.Structure):
    _fields_ = [("hidden", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I), ("inter", _I),
                ("block_size", _I), ("q8x_rows", _I), ("kvk", _I), ("eps", _F), ("scale", _F)]


def supported(model: torch.nn.Module, kv_dtype: torch.dtype) -> str | None:
    """None when every layer can run in C, else why not (logged once by the engine)."""
    cfg: ModelConfig = model.cfg  # type: ignore[assignment]
    lib = cpu_ops.library()
    why = [
        (lib is None, "no CPU kernels"),
        (cfg.mla is not None, "latent attention"),
        (any(layer.moe for layer in cfg.layers), "experts"),
        (cfg.qk_norm or cfg.gemma_norm or cfg.sandwich_norm, "q/k or Gemma norms"),
        (cfg.activation != "silu", f"activation {cfg.activation}"),
        (cfg.head_dim % 2 != 0, "odd head_dim"),
        (not cpu_ops.kv_supported(kv_dtype, cfg.head_dim), f"a {kv_dtype} KV cache"),
    ]
    for bad, reason in why:
        if bad:
            return reason
    for block in model.layers:  # type: ignore[attr-defined]
        mlp = block.mlp
        if not isinstance(mlp, MLP):
            return "not a gated MLP"
        for lin in (block.attn.qkv, block.attn.o, mlp.gate_up, mlp.down):
            if lin.quantized is None or len(lin.quantized) != 1:
                return "matmul weights not quantized (or in several formats)"
        for norm in (block.attn_norm, block.mlp_norm):
            if norm.weight.dtype != torch.float32:
                return "norms not float32"
    return None


class CpuDecodeLayers:
    """The C descriptors of every layer for one model and KV cache, built once."""

    def __init__(self, model: torch.nn.Module, kv: KVCache):
        cfg: ModelConfig = model.cfg  # type: ignore[assignment]
        lib = cpu_ops.library()
        assert lib is not None and supported(model, kv.layout.dtype) is None
        self.fn = lib.sf_decode_layers
        self.fn.argtypes = [_P, _P, _I, _P, _P, _I, _P, _P, _P, _I, _P, _P, _P, _I, _I, _P]
        self.fn.restype = _I
        self.ropes = list(cfg.ropes)
        self.kv = kv
        self.keep: list[torch.Tensor] = []  # biases converted here: alive as long as the descriptors
        self.steps = 0
        blocks = list(model.layers)  # type: ignore[attr-defined]
        self.dims = SfDims(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                           blocks[0].mlp.gate_up.quantized[0].shape[0] // 2, kv.layout.block_size,
                           quant.Q8X_MAX_ROWS, cpu_ops.KV_KINDS[kv.layout.dtype], cfg.rms_norm_eps, cfg.scale)
        self.layers = (SfLayer * len(blocks))()
        # Adapter rows may run here when every projection carries its adapters' stacks (`lora.LoRAWeights`).
        self.lora = all(lin.lora is not None for b in blocks
                        for lin in (b.attn.qkv, b.attn.o, b.mlp.gate_up, b.mlp.down))
        for i, (b, lc) in enumerate(zip(blocks, cfg.layers, strict=True)):
            layer_cache = kv.layer(i)
            assert cpu_ops.kv_supported(layer_cache.dtype, cfg.head_dim) and layer_cache.is_contiguous()
            self.layers[i] = SfLayer(b.attn_norm.weight.data_ptr(), b.mlp_norm.weight.data_ptr(),
                                     self._linear(b.attn.qkv), self._linear(b.attn.o), self._linear(b.mlp.gate_up),
                                     self._linear(b.mlp.down), layer_cache.data_ptr(), lc.window or 0,
                                     self.ropes.index(lc.rope))

    def _linear(self, lin: Linear) -> SfLinear:
        assert lin.quantized is not None
        w = lin.quantized[0]
        n, k = w.shape
        bias = None
        if lin.bias is not None:
            bias = lin.bias.float().contiguous()
            self.keep.append(bias)
        q8x = lin.int8_activations and w._q8x_ok()
        lora = lin.lora  # (its stacks are allocated once and updated in place: the pointers stay valid)
        if lora is not None:
            assert lora.bt is not None and lora.a_c.dtype == lora.bt.dtype in (torch.float32, torch.float16)
        return SfLinear(w.q.data_ptr(), w.scales.data_ptr(), None if w.mins is None else w.mins.data_ptr(),
                        None if bias is None else bias.data_ptr(), n, k, w.group_size, KINDS[w.kind], int(q8x),
                        None if lora is None else lora.a_c.data_ptr(),
                        None if lora is None or lora.bt is None else lora.bt.data_ptr(), 0 if lora is None else lora.rank,
                        int(lora is not None and lora.bt is not None and lora.bt.dtype == torch.float16))

    @staticmethod
    def applies(x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """A step small enough for the C kernels (decodes, speculative verifications, short prompt chunks)."""
        return (x.shape[0] <= min(quant.kernel_max_rows(), cpu_ops.SMALL_ROWS) and x.dtype == torch.float32
                and x.device.type == "cpu" and all(d.context_lens is not None for d in meta.decodes))

    @staticmethod
    def row_tables(meta: AttentionMetadata, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block table, context length) of every row: the C attention takes each row as a query of its
        own, so a chunk's row i (a verification's draft, a prompt token) attends the keys up to its
        own position — causal attention, with the chunk's K/V already in the cache."""
        if not meta.prefills and len(meta.decodes) == 1:  # the steady state: as the step built them
            d = meta.decodes[0]
            assert d.context_lens is not None
            return d.blocks, d.context_lens
        width = max([len(s.blocks) for s in meta.prefills] + [d.blocks.shape[1] for d in meta.decodes])
        tables = torch.zeros(rows, width, dtype=torch.long)
        ctx = torch.empty(rows, dtype=torch.long)
        for s in meta.prefills:
            tables[s.start : s.start + s.length, : len(s.blocks)] = s.blocks
            ctx[s.start : s.start + s.length] = torch.arange(s.context_len - s.length + 1, s.context_len + 1)
        for d in meta.decodes:
            assert d.context_lens is not None
            b = d.blocks.shape[0]
            tables[d.start : d.start + b, : d.blocks.shape[1]] = d.blocks
            ctx[d.start : d.start + b] = d.context_lens
        return tables, ctx

    def run(self, x: torch.Tensor, freqs: dict, meta: AttentionMetadata,
            aux_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(last layer's MLP output, residual stream, the residual stream entering each of `aux_layers`
        side by side or None): what the layer loop of `DecoderModel.forward` computes."""
        t = x.shape[0]
        layers = sorted(aux_layers)
        aux = torch.empty(t, len(layers) * x.shape[1]) if layers else None
        aux_ids = (ctypes.c_int * max(len(layers), 1))(*layers)
        res = x.contiguous()
        h = torch.empty_like(res)
        tables = [freqs[spec].contiguous() for spec in self.ropes]
        ptrs = (_P * len(tables))(*[f.data_ptr() for f in tables])
        blocks, ctx = (v.contiguous() for v in self.row_tables(meta, t))
        assert blocks.dtype == torch.int64 and ctx.dtype == torch.int64
        slots = meta.lora.slots if meta.lora is not None else None  # each row's adapter slot (LoRA rows)
        assert slots is None or (slots.dtype == torch.int64 and slots.is_contiguous())
        rc = self.fn(ctypes.byref(self.dims), self.layers, len(self.layers), res.data_ptr(), h.data_ptr(), t, ptrs,
                     meta.k_rows.data_ptr(), blocks.data_ptr(), blocks.shape[1], ctx.data_ptr(),
                     None if aux is None else aux.data_ptr(), aux_ids, len(layers), torch.get_num_threads(),
                     None if slots is None else slots.data_ptr())
        cpu_ops.check(rc, "decode layers")
        self.steps += 1
        return h, res, aux
