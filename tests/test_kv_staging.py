"""Staged head slices (`worker/kv/staging.py`) land exactly the bytes the row-by-row writes land: the
plain path (one entry per `[k|v, slot]` row, `kvtransfer.descriptors.layer_entries`) is the reference,
both applied as byte copies of their entries."""

from __future__ import annotations

import ctypes

import pytest
import torch

from engine.model.kv_cache import KVCache, KVLayout
from kvtransfer.config import TransferConfig
from kvtransfer.descriptors import HeadSlice, KVRegion, Run, layer_entries
from kvtransfer.transport import MooncakeTransport
from kvtransfer.writer import TransferJob
from worker.kv.staging import KVStaging, stageable

LAYERS, BLOCKS, BS, DIM = 3, 10, 4, 8


@pytest.fixture
def transport():  # (one per test: a buffer freed by one test may be allocated again at the same address)
    t = MooncakeTransport(TransferConfig())
    yield t
    t.close()


def source(heads: int) -> KVCache:
    kv = KVCache(KVLayout(LAYERS, BLOCKS, BS, heads, DIM, torch.float32), torch.device("cpu"))
    kv.buffer.copy_(torch.randn(kv.buffer.shape, generator=torch.Generator().manual_seed(heads)))
    return kv


def apply(entries_by_layer, dst: torch.Tensor) -> int:
    n = 0
    for entries in entries_by_layer:
        for e in entries:
            ctypes.memmove(e.dst, e.src, e.length)
            n += 1
    return n


def region(t: torch.Tensor, blocks: int, page: int) -> KVRegion:
    return KVRegion(t.data_ptr(), LAYERS, blocks, page)


@pytest.mark.parametrize("first,count", [(0, 2), (2, 2), (1, 1), (3, 1)])
def test_staged_pages_land_the_same_bytes_as_row_writes(transport, first, count):
    kv = source(4)
    rows, hb = 2 * BS, DIM * 4
    part = HeadSlice(rows, hb, 4, count, first, 0, count)
    runs = [Run(1, 5, 3), Run(7, 0, 2), Run(0, 9, 1)]
    dst_page = rows * count * hb
    ref = torch.zeros(LAYERS * 12 * dst_page, dtype=torch.uint8)
    got = torch.zeros_like(ref)
    src = KVRegion(kv.base_address, LAYERS, BLOCKS, kv.layout.page_bytes)
    plain = apply((layer_entries(src, region(ref, 12, dst_page), layer, runs, part) for layer in range(LAYERS)), ref)
    job = TransferJob("r", "seg", region(got, 12, dst_page), list(runs), part)
    staging = KVStaging(kv, transport.register)
    assert stageable(job) and staging.stage(job)
    assert job.part is None and job.src is not None and sum(r.count for r in job.runs) == 6
    entries = []
    for layer in range(LAYERS):
        staging.gather(layer)
        entries.append(layer_entries(job.src, job.dst, layer, job.runs, job.part))
    staged = apply(entries, got)
    assert torch.equal(ref, got) and ref.any()
    assert plain == LAYERS * 6 * rows and staged == LAYERS * len(runs)  # 144 entries -> 9
    staging.reset()
    assert staging.used == 0 and not staging.gathers


def test_only_strided_sources_with_whole_destination_rows_are_staged_and_only_what_fits(transport):
    kv = source(4)
    rows, hb = 2 * BS, DIM * 4
    into_more = TransferJob("a", "s", KVRegion(0, LAYERS, 4, rows * 8 * hb), [Run(0, 0, 2)],
                            HeadSlice(rows, hb, 4, 8, 0, 4, 4))  # the destination's rows are strided
    whole = TransferJob("b", "s", KVRegion(0, LAYERS, 4, kv.layout.page_bytes), [Run(0, 0, 2)], None)
    small = KVStaging(kv, transport.register, nbytes=LAYERS * rows * 2 * hb * 3)  # room for 3 half pages
    assert not stageable(into_more) and not small.stage(into_more) and not small.stage(whole)
    jobs = [TransferJob(f"j{i}", "s", KVRegion(0, LAYERS, 8, rows * 2 * hb), [Run(i, i, 2)],
                        HeadSlice(rows, hb, 4, 2, 2, 0, 2)) for i in range(2)]
    assert small.stage(jobs[0]) and not small.stage(jobs[1])  # 2 blocks fit, 2 more do not
    assert jobs[1].part is not None and jobs[1].src is None  # left as rows: still correct, slower
    assert small.buffer is not None and small.buffer.numel() == small.capacity
