"""Every supported decoder in one readable file (gpt-fast style).

Llama, Mistral, Qwen2/3, their mixture-of-experts variants, Gemma 3 and DeepSeek-V3 share one
block: pre-norm attention with RoPE and grouped KV heads (or DeepSeek's latent attention,
`mla.py`), then a gated MLP (or routed experts). What
differs is read from `ModelConfig`: q/k norms, biases, sliding-window layers with their own
RoPE, Gemma's (1 + w) norms, sandwich norms, embedding scale and logit soft-cap.

Tokens of every sequence in a step are flattened into one `[T, hidden]` tensor, so the
projections and MLP run as one matmul per layer whatever the batch mix; only attention needs
to know where each sequence starts, and that lives in `attention.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from common.errors import ModelLoadError
from engine.model import compressed_weight, quant
from engine.model.attention import AttentionMetadata, kernels_enabled, paged_attention, write_kv
from engine.model.compressed_weight import CompressedBF16
from engine.model.cpu_decode import CpuDecodeLayers, supported
from engine.model.kernels import cpu_ops
from engine.model.kv_cache import KVCache
from engine.model.layers import MLP, Linear, RMSNorm, cpu_packing_supported
from engine.model.lora import ExpertLoRA, LoRAState, LoRATarget, LoRAWeights
from engine.model.mla import MLAttention
from engine.model.model_config import LayerConfig, ModelConfig
from engine.model.moe import Experts, MoE
from engine.model.parallel import ONE, WHOLE, Shard, Stage
from engine.model.rope import RopeSpec, apply_rope, rope_cache

# Called after layer `i`'s K/V for this step are in the cache: the prefill worker uses it
# to start that layer's transfer while the next layer computes.
LayerHook = Callable[[int], None]


def _interleave_perm(d: int, device: torch.device | None = None) -> torch.Tensor:
    half = torch.arange(d // 2, device=device)
    return torch.stack((half, half + d // 2), dim=1).flatten()


def interleave_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorder q/k projection rows (or per-head norm weights, with num_heads=1) from the Hugging Face
    half-split RoPE layout (dim i pairs with i + d/2) to interleaved pairs (2i, 2i+1), so RoPE is one
    complex multiply.

    Only q and k are reordered, identically, so q·k (and so attention) is unchanged; the K
    cache simply holds head dims in this order.
    """
    d = w.shape[0] // num_heads
    return w.view(num_heads, d, *w.shape[1:])[:, _interleave_perm(d, w.device)].reshape(w.shape)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: LayerConfig, shard: Shard = ONE):
        super().__init__()
        # Tensor parallel: this rank's query heads and the KV heads they read (parallel.py).
        self.q_heads = shard.even(cfg.num_heads, "the attention heads")
        self.kv_heads = shard.kv_heads(cfg.num_heads, cfg.num_kv_heads)
        self.num_heads, self.num_kv_heads, self.head_dim = len(self.q_heads), len(self.kv_heads), cfg.head_dim
        q_out, kv_out = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.split = (q_out, kv_out, kv_out)
        # q, k and v fused into one matmul; the loader concatenates the checkpoint's three.
        self.qkv = Linear(cfg.hidden_size, sum(self.split), bias=cfg.qkv_bias)
        self.o = Linear(q_out, cfg.hidden_size, bias=cfg.o_bias and shard.rank == 0)
        if shard.parallel:
            self.o.reduce = shard
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.gemma_norm) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.gemma_norm) if cfg.qk_norm else None
        self.scale = cfg.scale
        self.window = layer.window

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, layer_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv(x)
        q_out, kv_out, _ = self.split
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        if (self.q_norm is None and qkv.dtype == torch.float32 and qkv.device.type == "cpu"
                and cpu_ops.kv_supported(layer_cache.dtype, d) and qkv.is_contiguous() and cpu_ops.small(t)):
            # One C call ropes q and k in place and stores k and v (cpu_ops.c).
            cpu_ops.rope_store(qkv, h, kvh, d, freqs, layer_cache, meta.k_rows, meta.block_size)
            q = qkv[:, :q_out].view(t, h, d)
        else:
            if self.q_norm is not None and self.k_norm is not None:
                q = apply_rope(self.q_norm(qkv[:, :q_out].view(t, h, d)), freqs)
                k = apply_rope(self.k_norm(qkv[:, q_out : q_out + kv_out].view(t, kvh, d)), freqs)
            else:
                # q and k are roped together: one complex multiply for both.
                qk = apply_rope(qkv[:, : q_out + kv_out].view(t, h + kvh, d), freqs)
                q, k = qk[:, :h], qk[:, h:]
            write_kv(layer_cache, k, qkv[:, q_out + kv_out :].view(t, kvh, d), meta)
        out = paged_attention(q, layer_cache, meta, self.scale, self.window)
        return self.o(out.reshape(t, -1))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: LayerConfig, shard: Shard = ONE):
        super().__init__()
        eps, gemma = cfg.rms_norm_eps, cfg.gemma_norm
        self.rope = layer.rope
        self.attn_norm = RMSNorm(cfg.hidden_size, eps, gemma)
        self.attn: nn.Module = MLAttention(cfg, layer, shard) if cfg.mla is not None else Attention(cfg, layer, shard)
        self.mlp_norm = RMSNorm(cfg.hidden_size, eps, gemma)
        self.mlp: nn.Module = (MoE(cfg, shard, shard.expert_parallel) if layer.moe
                               else MLP(cfg.hidden_size, cfg.intermediate_size, cfg.activation, cfg.mlp_bias, shard))
        # Gemma's "sandwich": the attention and MLP outputs are normed again before the residual add.
        self.attn_post_norm = RMSNorm(cfg.hidden_size, eps, gemma) if cfg.sandwich_norm else None
        self.mlp_post_norm = RMSNorm(cfg.hidden_size, eps, gemma) if cfg.sandwich_norm else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, freqs: torch.Tensor, layer_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(this block's MLP output, the residual stream before it is added): each residual add
        is fused with the norm that follows it (here, or in the next block / the final norm)."""
        if residual is None:
            residual = x
            h = self.attn_norm(x)
        else:
            h, residual = self.attn_norm.add_forward(x, residual)
        h = self.attn(h, freqs, layer_cache, meta)
        if self.attn_post_norm is not None:
            h = self.attn_post_norm(h)
        h, residual = self.mlp_norm.add_forward(h, residual)
        h = self.mlp(h)
        if self.mlp_post_norm is not None:
            h = self.mlp_post_norm(h)
        return h, residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard = ONE, stage: Stage = WHOLE):
        super().__init__()
        self.cfg = cfg
        self.shard = shard
        # Pipeline parallel: this stage's layers (`layer_ids`: their indices in the whole model); the
        # embedding where the first stage (or a tied LM head on the last) needs it, the LM head on the last.
        self.stage = stage
        self.layer_ids = stage.layer_ids(cfg.num_layers)
        # Tensor parallel: the embedding and LM head rows of this rank's slice of the vocabulary.
        self.vocab_rows = shard.vocab(cfg.vocab_size)
        rows = len(self.vocab_rows)
        embed_rows = rows if stage.first or (stage.last and cfg.tie_word_embeddings) else 0
        # Given its weight, Embedding skips its random init: on the meta device that init imports
        # torch._dynamo (2.5 s of every worker start, measured).
        self.embed = nn.Embedding(embed_rows, cfg.hidden_size, _weight=torch.empty(embed_rows, cfg.hidden_size))
        self.layers = nn.ModuleList(Block(cfg, cfg.layers[i], shard) for i in self.layer_ids)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma_norm)
        self.lm_head = Linear(cfg.hidden_size, rows if stage.last else 0, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.requires_grad_(False)
        self.rope_caches: dict[RopeSpec, torch.Tensor] = {}  # each [positions, head_dim/2] complex64
        self.embed_scale: float | None = None
        self.dtype = torch.get_default_dtype()  # `weights._allocate` builds the model under its dtype
        # A quantized embedding table (rows dequantized on lookup); when tied it is the LM head's.
        self.embed_quantized: quant.QuantizedWeight | None = None
        # `--compress-weights`: the table held compressed (rows decoded on lookup); when tied, the LM head's.
        self.embed_compressed: CompressedBF16 | None = None
        # Decode steps' layers in one C call where the model allows (cpu_decode.py); built on first use.
        self.cpu_layers: CpuDecodeLayers | None = None
        self.cpu_layers_off: str | None = None  # why not, once known
        # EAGLE-3: layers whose entering residual stream each step keeps in `aux_out` ([T, n x hidden]).
        self.aux_layers: tuple[int, ...] = ()
        self.aux_out: torch.Tensor | None = None
        self.weight_mapping: object | None = None  # the weight cache's mapping the parameters view (weight_cache.py)
        self.lora_in_c = True  # steps with adapter rows may take the fused CPU decode loop (False: the module path)
        self.lora: LoRAState | None = None  # resident LoRA adapters (`lora.py`): the step's rows of each

    def lora_targets(self) -> list[tuple[int, str, Linear | LoRATarget, int]]:
        """Every projection that takes LoRA adapters: (layer index, name, linear, fused parts). Attention q/k/v
        and o; latent attention's q_a (or q) and kv_a (fused: `qkv_a`), q_b, kv_b (read head by head: its
        deltas are added inside the attention, `MLAttention.adapters`) and o; MLP gate/up and down, and a
        mixture of experts' shared expert's (`shared.gate_up`, `shared.down`). Routed experts are
        `Experts.lora` (`lora.ExpertLoRA`)."""
        out: list[tuple[int, str, Linear | LoRATarget, int]] = []
        for i, layer in zip(self.layer_ids, self.layers, strict=True):
            attn, mlp = layer.attn, layer.mlp
            if isinstance(attn, Attention):
                out += [(i, "qkv", attn.qkv, 3), (i, "o", attn.o, 1)]
            elif isinstance(attn, MLAttention):
                out += [(i, "qkv_a", attn.qkv_a, 2), (i, "kv_b", attn.kv_b_target, 1), (i, "o", attn.o, 1)]
                if attn.q_b is not None:
                    out.append((i, "q_b", attn.q_b, 1))
            shared = mlp if isinstance(mlp, MLP) else mlp.shared if isinstance(mlp, MoE) else None
            prefix = "" if isinstance(mlp, MLP) else "shared."
            if shared is not None:
                out += [(i, prefix + "gate_up", shared.gate_up, 2), (i, prefix + "down", shared.down, 1)]
        return out

    def enable_lora(self, slots: int, max_rank: int, c_half: bool = False) -> None:
        """Room for `slots` resident LoRA adapters of rank up to `max_rank` on every projection that takes
        them (`lora_targets`; fused projections: their parts' ranks side by side). `c_half`: the fused CPU
        decode loop reads float16 copies of the factors (--lora-dtype float16)."""
        self.lora = LoRAState()
        device = self.norm.weight.device
        for _, _, lin, parts in self.lora_targets():
            lin.lora = LoRAWeights(self.lora, slots, parts * max_rank, lin.in_features, lin.out_features,
                                   self.dtype, device, c_half)
        for layer in self.layers:  # routed experts: their factors allocated by the first adapter that has any
            if isinstance(layer.mlp, MoE):
                ex = layer.mlp.experts
                ex.lora = ExpertLoRA(self.lora, slots, max_rank, ex.num_experts, self.cfg.hidden_size,
                                     len(layer.mlp.columns), self.dtype, device)

    @property
    def kv_entry(self) -> tuple[int, int, int]:
        """What this rank's paged cache holds per token and layer: (planes, heads, dim) of its KV heads."""
        planes, heads, dim = self.cfg.kv_entry
        attn = self.layers[0].attn
        return planes, (len(attn.kv_heads) if isinstance(attn, Attention) else heads), dim

    def build_rope_cache(self, max_positions: int, device: torch.device, dtype: torch.dtype) -> None:
        self.rope_caches = {spec: rope_cache(spec, self.cfg.head_dim, max_positions, device) for spec in self.cfg.ropes}
        if self.cfg.embed_scale is not None:
            # The scale rounded to the model dtype first, as the checkpoint's reference does.
            self.embed_scale = float(torch.tensor(self.cfg.embed_scale).to(dtype))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: KVCache,
        meta: AttentionMetadata,
        layer_hook: LayerHook | None = None,
        carry: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Any:
        """Returns final-normed hidden states `[T, hidden]`; logits are taken only where needed.
        Pipeline parallel: a stage after the first starts from the previous stage's `carry` (hidden
        states and residual stream) instead of the tokens, and a stage before the last returns its own."""
        assert self.rope_caches, "build_rope_cache() first"
        # Once per step and rope variant, shared by every layer that uses it.
        freqs = {spec: cache[positions].unsqueeze(1) for spec, cache in self.rope_caches.items()}
        residual: torch.Tensor | None
        if carry is not None:
            x, residual = carry
        else:
            x, residual = self.embed_tokens(input_ids), None
            if self.embed_scale is not None:
                x = x * self.embed_scale
        if self.lora is not None:
            self.lora.rows = meta.lora  # (read by every linear layer that carries adapters)
        whole = self.stage is WHOLE or (self.stage.first and self.stage.last)
        fused = (self._cpu_layers(kv) if whole and layer_hook is None and CpuDecodeLayers.applies(x, meta)
                 else None)
        if fused is not None and meta.lora is not None and not (self.lora_in_c and fused.lora):
            fused = None  # (adapter rows: the C loop adds their deltas after each projection, `sf_lora_rows`)
        if fused is not None:
            x, residual, self.aux_out = fused.run(x, freqs, meta, self.aux_layers)
            return self.norm.add_forward(x, residual)[0]
        aux: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            if i in self.aux_layers:  # (a copy: later layers update the residual stream in place)
                aux.append(x.clone() if residual is None else x + residual)
            x, residual = layer(x, residual, freqs[layer.rope], kv.layer(i), meta)
            if layer_hook is not None:
                layer_hook(i)
        self.aux_out = torch.cat(aux, dim=-1) if aux else None
        assert residual is not None
        if not self.stage.last:
            return x, residual
        return self.norm.add_forward(x, residual)[0]

    def cpu_layers_unavailable(self, kv: KVCache) -> str | None:
        """Why decode steps cannot run in the fused CPU loop (`cpu_decode.py`) over `kv`, or None."""
        if kv.buffer.device.type != "cpu":
            return f"a {kv.buffer.device.type} device"
        return ("Triton kernels on CPU" if kernels_enabled(kv.buffer.device) else
                "tensor parallel" if self.shard.parallel else supported(self, kv.layout.dtype))

    def _cpu_layers(self, kv: KVCache) -> CpuDecodeLayers | None:
        if self.cpu_layers is not None and self.cpu_layers.kv is kv:
            return self.cpu_layers
        if self.cpu_layers_off is None:
            self.cpu_layers_off = self.cpu_layers_unavailable(kv)
        if self.cpu_layers_off:
            return None
        self.cpu_layers = CpuDecodeLayers(self, kv)
        return self.cpu_layers

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        if self.shard.parallel:  # vocab-parallel: this rank's rows, zeros elsewhere, summed over the ranks
            first = self.vocab_rows.start
            mine = (ids >= first) & (ids < self.vocab_rows.stop)
            local = torch.where(mine, ids - first, torch.zeros_like(ids))
            x = self._lookup(local) * mine.unsqueeze(-1).to(self.dtype)
            return self.shard.all_reduce(x)
        return self._lookup(ids)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed_quantized is not None:
            return self.embed_quantized.dequantize(ids).to(self.dtype)
        if self.embed_compressed is not None:
            return compressed_weight.embedding(ids, self.embed_compressed).to(self.dtype)
        return self.embed(ids)

    def set_embedding_quantized(self, qw: quant.QuantizedWeight) -> None:
        """Lookups read `qw`'s rows; the float table is freed. Tied: the LM head multiplies by it too."""
        self.embed_quantized = qw
        if self.cfg.tie_word_embeddings and self.lm_head.weight is not None and self.lm_head.weight.numel():
            self.lm_head.set_quantized([qw])
        self.embed.weight = nn.Parameter(self.embed.weight.new_empty(0, self.cfg.hidden_size), requires_grad=False)

    def compress_weights(self) -> int:
        """`--compress-weights`: every bfloat16 linear layer's weight (routers and LM head included), the
        stacked experts and the embedding table (when tied, the LM head multiplies by the same compressed
        table) packed into the in-memory compressed form and their bfloat16 tensors freed. Returns the bytes
        saved."""
        from engine.model.compressed_weight import pack

        saved = 0
        table = self.embed.weight
        if table.dtype == torch.bfloat16 and table.numel() and self.embed_quantized is None:
            c = pack(table)
            saved += table.numel() * table.element_size() - c.nbytes
            self.embed_compressed = c
            if self.cfg.tie_word_embeddings and self.lm_head.weight is not None and self.lm_head.weight.numel():
                self.lm_head.set_compressed(c)
            self.embed.weight = nn.Parameter(table.new_empty(0, self.cfg.hidden_size), requires_grad=False)
        for m in self.modules():
            if isinstance(m, Experts):
                saved += m.compress()  # (nothing when quantized or packed: their stacks are gone)
            w = m.weight if isinstance(m, Linear) else None
            if (w is None or m.quantized is not None or m.packed is not None or w.dtype != torch.bfloat16
                    or w.dim() != 2 or not w.numel()):
                continue
            c = pack(w)
            saved += w.numel() * w.element_size() - c.nbytes
            m.set_compressed(c)
        return saved

    def quantize(self, kind: str) -> None:
        """`--quantization int8|int4|fp8` on a float checkpoint: every matmul weight quantized round-to-nearest
        per group of 32 (int4) or up to 128 (int8, fp8) weights; under int8/int4 the LM head (and, when
        tied, the embedding with it) at int8, under fp8 left in the model dtype (as the published FP8
        checkpoints leave it). Routers stay float (a flipped expert choice costs more than the bytes
        save); experts are quantized one by one."""
        skip: set[int] = set()
        for m in self.modules():
            if isinstance(m, MoE):
                skip |= {id(m.router), id(m.shared_gate)}
        for name, m in self.named_modules():
            if (isinstance(m, Linear) and id(m) not in skip and m.quantized is None and m is not self.lm_head
                    and m.weight.numel()):
                m.set_quantized([quant.quantize(m.weight, kind, self._group_size(name, m, kind))])
            elif isinstance(m, Experts):
                m.quantize(kind)
        if kind == "fp8":
            return
        # (Pipeline parallel: a first stage without the LM head still quantizes a tied embedding the same way.)
        tied_table = self.cfg.tie_word_embeddings and self.embed_quantized is None and self.embed.weight.numel()
        if self.lm_head.quantized is None and (self.lm_head.weight.numel() or tied_table):
            # The LM head (and a tied embedding) stays at 8 bits under int4, as llama.cpp's 4-bit files
            # keep theirs at Q8_0/Q6_K: on SmolLM2 a 4-bit head cost 6% perplexity, 4-bit layers ~1%.
            head = self.lm_head.weight if self.lm_head.weight.numel() else self.embed.weight
            head_kind = "int8"
            qw = quant.quantize(head, head_kind, quant.group_size_for(head.shape[1], head_kind))
            if self.cfg.tie_word_embeddings:
                self.set_embedding_quantized(qw)
            else:
                self.lm_head.set_quantized([qw])

    def _group_size(self, name: str, m: Linear, kind: str) -> int:
        """The group the whole model's weight would be quantized in: a row-parallel rank's columns are
        a slice of the whole row, and whole groups of it, so every rank quantizes what one device would."""
        k = m.weight.shape[1]
        if m.reduce is None:
            return quant.group_size_for(k, kind)
        g = quant.group_size_for(k * self.shard.size, kind)
        if k % g:
            raise ModelLoadError(f"--quantization {kind} with tensor parallel size {self.shard.size}: {name}'s "
                                 f"{k * self.shard.size} columns split {k} per rank, not whole {g}-column groups")
        return g

    def set_int8_activations(self, on: bool) -> None:
        """Quantized matmuls at batch 1-2 on CPU take int8-rounded activations (see quant.linear)."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.int8_activations = on
        self.cpu_layers = None  # its descriptors carry the mode

    def optimize_for_cpu(self, dropped: Callable[[torch.Tensor], None] | None = None) -> None:
        """Pack every matmul weight for oneDNN where this CPU supports it for the model dtype (see
        `layers.Linear`); the tied embedding keeps its table. `dropped` sees each original weight the
        packing let go of (a mapped load gives its pages back: `weight_cache.PageRelease`)."""
        dtype = self.embed.weight.dtype
        if dtype not in (torch.float32, torch.bfloat16) or not cpu_packing_supported(dtype):
            return
        for m in self.modules():
            if isinstance(m, Linear) and m.weight is not None and m.weight.numel():
                original = m.weight
                m.pack_for_cpu(keep_original=m is self.lm_head and self.cfg.tie_word_embeddings)
                if dropped is not None and m.weight is None and original is not None:
                    dropped(original)
            elif isinstance(m, Experts):
                originals = (m.gate_up, m.down)
                m.pack_for_cpu()
                if dropped is not None and m.gate_up is None and m.packed is not None:
                    for t in originals:
                        dropped(t)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.shard.parallel:  # vocab-parallel: every rank's slice, the padding past the vocabulary cut
            logits = self.shard.all_gather(logits)[:, : self.cfg.vocab_size]
        cap = self.cfg.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
