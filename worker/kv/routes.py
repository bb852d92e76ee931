"""Which rank of a prefill worker writes which KV heads into which rank of a decode worker.

A tensor-parallel rank holds its own KV heads of every page (`engine/model/parallel.Shard.kv_heads`:
an even split, or with fewer KV heads than ranks one head replicated over several ranks); a latent
cache (MLA) is whole on every rank. Two workers split the same way pair rank r with rank r, whole
pages. Split differently (a prefill worker with `-tp a` feeding a decode worker with `-tp b`), every
head a decode rank holds is written by exactly one prefill rank that holds it — the one with the same
index when it does, else the holders in turn, so replicated heads spread the work — and a run of
consecutive heads from one source is one `HeadSlice` (one entry per `[k|v, slot]` row of a page,
because a head subset of a page is strided).

Pipeline parallel: a rank's cache holds its stage's layers only (local layer 0 = the stage's first). A
worker split over `pp` stages of `tp` ranks each numbers its ranks `stage * tp + tp rank`; a route then
also names the source rank's layers it writes (those the destination rank's stage holds too) and how
far the two stages' first layers lie apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

from engine.model.model_config import ModelConfig
from engine.model.parallel import Shard
from kvtransfer.descriptors import HeadSlice


@dataclass(frozen=True)
class Route:
    src_rank: int
    dst_rank: int
    part: HeadSlice
    layers: range | None = None  # the source rank's (local) layers this route writes; None: all of them
    layer_shift: int = 0  # destination local layer = source local layer + layer_shift


def stage_layout(ranges: list[range], num_layers: int) -> tuple[int, list[range]]:
    """(tensor-parallel size, stages) of a worker whose ranks, in order, hold these layer ranges; raises
    ValueError when they are not `pp` stages of `tp` ranks covering the model's `num_layers` in order."""
    tp = next((i for i, r in enumerate(ranges) if r != ranges[0]), len(ranges))
    stages = ranges[::tp]
    if (len(ranges) % tp or any(ranges[i] != stages[i // tp] for i in range(len(ranges)))
            or stages[0].start != 0 or stages[-1].stop != num_layers
            or not all(stages) or any(a.stop != b.start for a, b in pairwise(stages))):
        raise ValueError(f"ranks holding layers {[(r.start, r.stop) for r in ranges]} are not pipeline stages of "
                         f"equal tensor-parallel groups covering the model's {num_layers} layers")
    return tp, stages


@dataclass(frozen=True)
class KVSplit:
    """How one worker's KV pages are split over its `size` tensor-parallel ranks."""

    cfg: ModelConfig
    size: int
    block_size: int
    element_size: int  # bytes of one cached value (the KV cache dtype)
    stages: tuple[range, ...] = ()  # pipeline stages' layers (empty: one stage of every layer)

    @property
    def stage_ranges(self) -> list[range]:
        return list(self.stages) or [range(self.cfg.num_layers)]

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

    def routes_to(self, dst_size: int, dst_stages: list[range] | None = None) -> list[Route]:
        """Every write of a page from this worker's ranks into a worker split over `dst_size` tensor-parallel
        ranks (in each of `dst_stages`, its pipeline stages' layers; None: one stage)."""
        heads = self._head_routes(dst_size)
        src_stages, dst_stages = self.stage_ranges, dst_stages or [range(self.cfg.num_layers)]
        if len(src_stages) == len(dst_stages) == 1:
            return heads
        out: list[Route] = []
        for sp, a in enumerate(src_stages):
            for sd, b in enumerate(dst_stages):
                lo, hi = max(a.start, b.start), min(a.stop, b.stop)
                if lo < hi:
                    out.extend(Route(sp * self.size + h.src_rank, sd * dst_size + h.dst_rank, h.part,
                                     range(lo - a.start, hi - a.start), a.start - b.start) for h in heads)
        return out

    def _head_routes(self, dst_size: int) -> list[Route]:
        """Which tensor-parallel rank writes which heads into which, within one pair of stages."""
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
