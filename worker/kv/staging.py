"""Gathering some KV heads of each page into whole destination pages before they are written.

A rank that holds more KV heads per page than the decode rank it writes to (a prefill worker with `-tp a`
feeding one with `-tp b`, a < b) sends a head slice: the destination's rows are whole but the source's
are strided, so written in place each `[k|v, slot]` row is a Mooncake entry of its own (32 per page at
block size 16). Staged, the heads the destination holds are first copied out of the layer's pages into a
registered buffer laid out as the destination's pages (one strided tensor copy per job and layer, on the
sender thread once the layer is computed), and written from there as whole pages: one entry per run of
consecutive blocks. The destination's bytes are the same either way (`tests/test_kv_staging.py` holds
the two equal).

A step's staged jobs share the buffer (`STAGING_BYTES`, allocated and registered the first time a job
needs it); a job that does not fit is written as rows, as before. The buffer is reused once the step's
writes have completed (`LayerWrites.finish`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.model.kv_cache import KVCache
from kvtransfer.descriptors import KVRegion, Run
from kvtransfer.writer import TransferJob

STAGING_BYTES = 64 << 20


@dataclass
class _Gather:
    view: torch.Tensor  # [layers, blocks, planes, block size, heads, dim]: the staged pages
    index: torch.Tensor  # the source blocks, in staged order
    first: int  # first source head
    count: int  # heads


def stageable(job: TransferJob) -> bool:
    """A head slice whose destination rows are whole and whose source rows are not."""
    p = job.part
    return p is not None and not p.whole and p.count == p.dst_heads < p.src_heads


class KVStaging:
    def __init__(self, kv: KVCache, register: Callable[[int, int, str], None], nbytes: int = STAGING_BYTES):
        """`register(address, nbytes, location)`: make the buffer a write source (the rank's transport)."""
        self.kv = kv
        self.register = register
        self.capacity = nbytes
        self.buffer: torch.Tensor | None = None
        self.used = 0
        self.gathers: list[_Gather] = []
        self.stream = torch.cuda.Stream(kv.buffer.device) if kv.buffer.device.type == "cuda" else None

    def _allocate(self) -> torch.Tensor:
        if self.buffer is None:
            dev = self.kv.buffer.device
            self.buffer = torch.empty(self.capacity, dtype=torch.uint8, device=dev)
            self.register(self.buffer.data_ptr(), self.capacity,
                          f"cuda:{dev.index or 0}" if dev.type == "cuda" else "cpu:0")
        return self.buffer

    def stage(self, job: TransferJob) -> bool:
        """Turn `job` (in place) into whole-page writes from the staging buffer, if it is a stageable head
        slice and fits this step's remaining room; False leaves it as it was."""
        if not stageable(job):
            return False
        assert job.part is not None
        layout = self.kv.layout
        blocks = [r.src_block + i for r in job.runs for i in range(r.count)]
        page = job.part.rows * job.part.dst_heads * job.part.head_bytes
        need = len(blocks) * layout.num_layers * page
        if self.used + need > self.capacity or page != job.dst.page_bytes:
            return False
        buffer = self._allocate()
        shape = (layout.num_layers, len(blocks), layout.planes, layout.block_size, job.part.count, layout.head_dim)
        view = buffer[self.used : self.used + need].view(layout.dtype).view(shape)
        index = torch.tensor(blocks, dtype=torch.long, device=buffer.device)
        self.gathers.append(_Gather(view, index, job.part.src_first, job.part.count))
        runs, k = [], 0
        for r in job.runs:
            runs.append(Run(k, r.dst_block, r.count))
            k += r.count
        job.src = KVRegion(buffer.data_ptr() + self.used, layout.num_layers, len(blocks), page)
        job.runs, job.part = runs, None
        self.used += need
        return True

    def gather(self, layer: int) -> None:
        """Copy layer `layer`'s staged heads into the buffer (its K/V are computed: `LayerEvents`)."""
        if not self.gathers:
            return
        src = self.kv.layer(layer)
        if self.stream is None:
            self._copy(src, layer)
            return
        with torch.cuda.stream(self.stream):
            self._copy(src, layer)
        self.stream.synchronize()

    def _copy(self, src: torch.Tensor, layer: int) -> None:
        for g in self.gathers:  # the heads of each source block, straight into the staged pages
            torch.index_select(src[..., g.first : g.first + g.count, :], 0, g.index, out=g.view[layer])

    def reset(self) -> None:
        """The step's writes are done: the buffer is free again."""
        self.used = 0
        self.gathers = []
