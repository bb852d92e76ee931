"""Tensor parallelism: which part of each weight and KV head a rank holds, and the collectives.

Megatron's split, per block: q/k/v and gate/up are column-parallel (each rank computes its own
heads and its slice of the intermediate size), o and down are row-parallel (each rank multiplies its
slice and one all-reduce sums the partial outputs), so a block costs two all-reduces of
`[tokens, hidden]`. The embedding and the LM head are vocab-parallel: each rank holds a contiguous
slice of the vocabulary (padded to equal slices); a lookup is masked to the rank's rows and
all-reduced, logits are all-gathered. Norms, RoPE and everything per token are replicated.

KV heads are split with the query heads they serve. With fewer KV heads than ranks each KV head is
replicated on `size / kv_heads` ranks (a rank's query heads all read one KV head), as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.errors import ModelLoadError
from engine.model.collectives import Collectives
from engine.model.model_config import ModelConfig


@dataclass(frozen=True)
class Shard:
    """This rank's place in a tensor-parallel group (`size` 1: the whole model, no collectives)."""

    rank: int = 0
    size: int = 1
    group: Collectives | None = None  # the ranks' collectives (None when size is 1; `collectives.py`, `engine/ranks.py`)
    expert_parallel: bool = False  # routed experts placed whole on the ranks, instead of each split (moe.MoE)

    @property
    def parallel(self) -> bool:
        return self.size > 1

    def even(self, n: int, what: str) -> range:
        """This rank's part of `n` units split evenly (heads, intermediate columns)."""
        if n % self.size:
            raise ModelLoadError(f"tensor parallel size {self.size} does not divide {what} ({n})")
        part = n // self.size
        return range(self.rank * part, (self.rank + 1) * part)

    def kv_heads(self, num_heads: int, num_kv_heads: int) -> range:
        """The KV heads this rank's query heads read: a split when there are at least as many KV heads
        as ranks, else the one KV head, replicated on `size / num_kv_heads` ranks."""
        if num_kv_heads >= self.size:
            return self.even(num_kv_heads, "the KV heads")
        if self.size % num_kv_heads:
            raise ModelLoadError(f"tensor parallel size {self.size} is not a multiple of the model's "
                                 f"{num_kv_heads} KV heads (each would be split unevenly)")
        self.even(num_heads, "the attention heads")
        kv = self.rank // (self.size // num_kv_heads)
        return range(kv, kv + 1)

    def vocab(self, vocab_size: int) -> range:
        """This rank's rows of the embedding / LM head: equal slices of the vocabulary rounded up (the
        last rank's slice may run past `vocab_size`: those rows are zeros and their logits cut)."""
        part = -(-vocab_size // self.size)
        return range(self.rank * part, (self.rank + 1) * part)

    # -- collectives (no-ops on one rank) ---------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place (`x` contiguous)."""
        if self.group is not None:
            self.group.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' `x` side by side along the last dimension (rank order)."""
        return x if self.group is None else self.group.all_gather(x)


ONE = Shard()


@dataclass(frozen=True)
class Stage:
    """This rank's pipeline stage: a contiguous run of the layers (`layers`; None: all of them). The first
    stage embeds the tokens, the last one norms and takes logits; hidden states (and the residual
    stream) go from one stage to the next (`engine/ranks.py`)."""

    index: int = 0
    count: int = 1
    layers: range | None = None

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def layer_ids(self, num_layers: int) -> range:
        return self.layers if self.layers is not None else range(num_layers)


WHOLE = Stage()


def layer_costs(cfg: ModelConfig) -> tuple[list[float], float, float]:
    """What each layer costs a decode step, and the embedding's and the LM head's, in weights read per
    token (a decode step is bandwidth-bound): attention and a dense MLP read all of theirs, a MoE layer
    its top-k experts and shared ones; the LM head reads vocabulary x hidden, the embedding one row."""
    h = cfg.hidden_size
    costs = []
    for layer in cfg.layers:
        if cfg.mla is not None:
            m = cfg.mla
            qk = m.qk_nope_head_dim + m.qk_rope_head_dim
            q = (h * m.q_lora_rank + m.q_lora_rank * cfg.num_heads * qk) if m.q_lora_rank else h * cfg.num_heads * qk
            attn = q + h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * cfg.num_heads * (
                m.qk_nope_head_dim + m.v_head_dim) + cfg.num_heads * m.v_head_dim * h
        else:
            attn = 2 * h * cfg.num_heads * cfg.head_dim + 2 * h * cfg.num_kv_heads * cfg.head_dim
        if layer.moe and cfg.moe is not None:
            mlp = 3 * h * cfg.moe.intermediate_size * cfg.moe.top_k + 3 * h * cfg.moe.shared_intermediate_size
        else:
            mlp = 3 * h * cfg.intermediate_size
        costs.append(float(attn + mlp))
    return costs, float(h), float(cfg.vocab_size * h)


def split_layers(cfg: ModelConfig, stages: int) -> list[range]:
    """Contiguous layer ranges, one per stage, that make the costliest stage as cheap as possible
    (`layer_costs`; the first stage also pays the embedding, the last the LM head). Every stage gets
    at least one layer."""
    costs, embed, head = layer_costs(cfg)
    n = len(costs)
    if not 1 <= stages <= n:
        raise ModelLoadError(f"pipeline parallel size {stages} must be between 1 and the model's {n} layers")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(a: int, b: int, s: int) -> float:
        return prefix[b] - prefix[a] + (embed if s == 0 else 0.0) + (head if s == stages - 1 else 0.0)

    # best[s][i]: the smallest max stage cost placing layers i.. on stages s..; cut[s][i]: where stage s ends.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[stages][n] = 0.0
    for s in range(stages - 1, -1, -1):
        for i in range(n - 1, -1, -1):
            left = stages - s - 1  # stages after this one, each needing a layer
            for j in range(i + 1, n - left + 1):
                v = max(cost(i, j, s), best[s + 1][j])
                if v < best[s][i]:
                    best[s][i], cut[s][i] = v, j
    out, i = [], 0
    for s in range(stages):
        out.append(range(i, cut[s][i]))
        i = cut[s][i]
    return out
