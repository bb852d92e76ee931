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
