"""A Llama-family decoder in one readable file (gpt-fast style).

Tokens of every sequence in a step are flattened into one `[T, hidden]` tensor, so
the projections and MLP run as one matmul per layer whatever the batch mix; only
attention needs to know where each sequence starts, and that lives in `attention.py`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, paged_attention, write_kv
from engine.kv_cache import KVCache
from engine.model_config import ModelConfig

# Called after layer `i`'s K/V for this step are in the cache: the prefill worker uses it
# to start that layer's transfer while the next layer computes.
LayerHook = Callable[[int], None]


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    return inv_freq.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves (the Hugging Face layout): x is [T, heads, dim], cos/sin [T, 1, dim/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Linear(nn.Module):
    """`nn.Linear` that on CPU also keeps a transposed copy of wide weights for single-row inputs.

    Measured on this project's 2-core EPYC (fp32, weights streamed from DRAM): for one row,
    `x @ W_t` with W_t `[in, out]` contiguous beats `F.linear` where out > in (gate_up
    635 -> 347 us, lm_head 10.3 -> 5.9 ms), while for 8+ rows `F.linear` is faster. Batch-1
    decode is the latency case, so both layouts are kept for those weights.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.weight_t: torch.Tensor | None = None

    def add_row_layout(self) -> None:
        if self.weight.shape[0] > self.weight.shape[1]:
            self.weight_t = self.weight.detach().t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_t is not None and x.shape[0] == 1:
            if self.bias is not None:
                return torch.addmm(self.bias, x, self.weight_t)
            return x @ self.weight_t
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.split = (q_out, kv_out, kv_out)
        # q, k and v fused into one matmul; the loader concatenates the checkpoint's three.
        self.qkv = Linear(cfg.hidden_size, sum(self.split), bias=cfg.attention_bias)
        self.o = Linear(q_out, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(x).split(self.split, dim=-1)
        q = apply_rope(q.view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(t, self.num_kv_heads, self.head_dim), cos, sin)
        write_kv(layer_cache, k, v.view(t, self.num_kv_heads, self.head_dim), meta)
        out = paged_attention(q, layer_cache, meta, self.scale)
        return self.o(out.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, layer_cache, meta) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, layer_cache, meta)
        return x + self.mlp(self.mlp_norm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.requires_grad_(False)
        self.rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def build_rope_cache(self, max_positions: int, device: torch.device, dtype: torch.dtype) -> None:
        inv_freq = rope_inv_freq(self.cfg).to(device)
        freqs = torch.outer(torch.arange(max_positions, device=device, dtype=torch.float32), inv_freq)
        self.rope_cache = (freqs.cos().to(dtype), freqs.sin().to(dtype))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: KVCache,
        meta: AttentionMetadata,
        layer_hook: LayerHook | None = None,
    ) -> torch.Tensor:
        """Returns final-normed hidden states `[T, hidden]`; logits are taken only where needed."""
        assert self.rope_cache is not None, "build_rope_cache() first"
        cos = self.rope_cache[0][positions].unsqueeze(1)
        sin = self.rope_cache[1][positions].unsqueeze(1)
        x = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv.layer(i), meta)
            if layer_hook is not None:
                layer_hook(i)
        return self.norm(x)

    def optimize_for_cpu(self) -> None:
        """See `Linear`: wide weights get a second, transposed copy for single-row steps."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.add_row_layout()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
