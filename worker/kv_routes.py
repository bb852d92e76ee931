"""Which rank of a prefill worker writes which KV heads into which rank of a decode worker.

A tensor-parallel rank holds its own KV heads of every page (`engine/model/parallel.Shard.kv_heads`:
an even split, or with fewer KV heads than ranks one head replicated over several ranks); a latent
cache (MLA) is whole on every rank. Two workers split the same way pair rank r with rank r, whole
pages. Split differently (a prefill worker with `-tp a` feeding a decode worker with `-tp b`), every
head a decode rank holds is written by exactly one prefill rank that holds it — the one with the same
index when it does, else the holders in turn, so replicated heads spread the work — and a run of
consecutive heads from one source is one `HeadSlice` (one entry per `[k|v, slot]` row of a page,
because a head subset of a page is strided).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.model.model_config import ModelConfig
from engine.model.parallel import Shard
from kvtransfer.descriptors import HeadSlice


@dataclass(frozen=True)
class Route:
    src_rank: int
    dst_rank: int
    part: HeadSlice


@dataclass(frozen=True)
class KVSplit:
    """How one worker's KV pages are split over its `size` tensor-parallel ranks."""

    cfg: ModelConfig
    size: int
    block_size: int
    element_size: int  # bytes of one cached value (the KV cache dtype)

    def head_ranges(self, size: int) -> list[range]:
        """The model's KV heads each of `size` ranks holds (MLA: the one latent, on every rank).
        Raises `ModelLoadError` when the model cannot be split over `size` ranks."""
        if self.cfg.mla is not None:
            return [range(0, 1)] * size
        return [Shard(rank, size).kv_heads(self.cfg.num_heads, self.cfg.num_kv_heads) for rank in range(size)]

    def page_bytes(self, size: int) -> int:
        """One rank's page (a block's K and V in one layer) when the model is split over `size` ranks."""
        planes, _, dim = self.cfg.kv_entry
        return planes * self.block_size * len(self.head_ranges(size)[0]) * dim * self.element_size

    def routes_to(self, dst_size: int) -> list[Route]:
        """Every write of a page from this worker's ranks into a worker split over `dst_size` ranks."""
        planes, _, dim = self.cfg.kv_entry
        src, dst = self.head_ranges(self.size), self.head_ranges(dst_size)
        out: list[Route] = []
        for d, want in enumerate(dst):
            owners = []
            for h in want:
                holders = [r for r, have in enumerate(src) if h in have]
                owners.append(d if d in holders else holders[d % len(holders)])
            i = 0
            while i < len(want):
                j = i
                while j + 1 < len(want) and owners[j + 1] == owners[i]:
                    j += 1
                r = owners[i]
                out.append(Route(r, d, HeadSlice(planes * self.block_size, dim * self.element_size, len(src[r]),
                                                 len(want), want[i] - src[r].start, i, j - i + 1)))
                i = j + 1
        return out
