"""Decode steps replayed from static buffers, one set per batch-size bucket (CUDA graphs on a GPU).

An eager decode step pays Python and a kernel launch per op; a captured CUDA graph replays the
whole forward pass in one launch. Graphs need fixed shapes and fixed addresses, so a decode-only
batch of n sequences is padded to the smallest bucket >= n (1, 2, 4, 8, ... up to max_num_seqs)
and its inputs are copied into that bucket's static tensors: token ids, positions, KV write rows,
block tables (every row as wide as the longest context allows) and context lengths. Padding rows
read and write only a scratch KV block that the block manager never hands out, so they cannot
touch a real sequence's cache. Sampling stays outside, on the first n rows.

Everything here but the capture itself is plain torch and runs the same on CPU, where "replay"
is calling the padded forward: CPU tests prove the padding (bucket output == unpadded output),
that buffers are never reallocated, and that batches above the largest bucket run eagerly. On CPU
it is off by default (padding only costs there); on CUDA it is on unless --enforce-eager.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from engine.model.attention import AttentionMetadata, DecodeBatch

# What makes the host wait for the device, so a CUDA graph cannot record it (capture fails with
# "operation not permitted when stream is capturing"): reading a value back (`.item()`,
# `.tolist()`, `int()`, `bool()`, `.cpu()`), or an op whose output size depends on the data (on
# CUDA `bincount` reads its input's maximum back; `repeat_interleave` sums a tensor of repeats).
HOST_READS = frozenset({"tolist", "item", "numpy", "cpu", "__int__", "__float__", "__bool__", "__index__"})
DATA_SIZED_OPS = frozenset({"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select", "bincount",
                            "_unique", "_unique2", "unique_dim", "unique_consecutive", "repeat_interleave", "histc"})


class _DataSized(TorchDispatchMode):
    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.overloadpacket.__name__ in DATA_SIZED_OPS:
            self.seen.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


class HostSyncProbe(TorchFunctionMode):
    """Records every data-sized op, and every host read of a tensor on `device_type`, run while active:
    CPU tests run the decode forward under it to prove the CUDA path holds none (there every tensor
    stands for a device one), and on CUDA the engine checks before it captures."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.seen: list[str] = []
        self._ops = _DataSized(self.seen)

    def __enter__(self):  # type: ignore[no-untyped-def]
        self._ops.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):  # type: ignore[no-untyped-def]
        super().__exit__(*exc)
        self._ops.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if (getattr(func, "__name__", "") in HOST_READS and args and isinstance(args[0], torch.Tensor)
                and args[0].device.type == self.device_type):
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


def buckets_for(max_num_seqs: int) -> list[int]:
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    return [*out, max_num_seqs]


@dataclass
class StaticBatch:
    """One bucket's fixed tensors; `hidden` is where the forward writes its output.

    The inputs are views of one flat device buffer `flat` laid out [input_ids | positions | k_rows |
    context_lens | carried | settings | tables], filled from its mirror `host` (pinned on CUDA; the
    same tensor on CPU) through numpy and sent in one copy per step. `carried` (async scheduling): per
    row, the index of its token in `DecodeGraphs.tokens`, the previous step's samples still on the
    device (-1: the token is in `input_ids`); the graph itself takes them from there. `settings` (async
    scheduling, a sampled row): its `sampler.row_settings` as float32 bit patterns, for the sampler
    after the graph. `copied` (CUDA): recorded after the copy, waited on before the mirror is written
    again (a step may be queued behind the previous one, its copy not yet made)."""

    size: int
    flat: torch.Tensor  # [9B + B * max_blocks] int64
    host: torch.Tensor
    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    k_rows: torch.Tensor  # [B] int64: row of each token's K in the layer cache viewed as [rows, kv_heads, dim]
    context_lens: torch.Tensor  # [B] int64
    carried: torch.Tensor  # [B] int64
    settings: torch.Tensor  # [B, 4] int64 (float32 bits)
    tables: torch.Tensor  # [B, max_blocks] int64
    host_np: Any = None  # numpy view of `host` (made once: on CPU `host` is the device buffer itself)
    hidden: torch.Tensor | None = None
    graph: object | None = None  # torch.cuda.CUDAGraph once captured
    copied: Any = None  # torch.cuda.Event after the last copy of `host` (CUDA)

    @classmethod
    def make(cls, b: int, max_blocks: int, device: torch.device) -> StaticBatch:
        flat = torch.zeros(9 * b + b * max_blocks, dtype=torch.long, device=device)
        host = flat if device.type == "cpu" else torch.zeros(flat.shape, dtype=torch.long, pin_memory=True)
        return cls(b, flat, host, flat[:b], flat[b : 2 * b], flat[2 * b : 3 * b], flat[3 * b : 4 * b],
                   flat[4 * b : 5 * b], flat[5 * b : 9 * b].view(b, 4), flat[9 * b :].view(b, max_blocks),
                   host.numpy())


class DecodeGraphs:
    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
                 max_num_seqs: int, max_blocks: int, block_size: int, scratch_block: int, device: torch.device,
                 planes: int = 2):
        self.forward = forward
        self.block_size = block_size
        self.planes = planes  # K|V pages, or 1 for a latent cache
        self.scratch_block = scratch_block
        self.device = device
        self.buckets = buckets_for(max_num_seqs)
        # The last queued step's sampled tokens (async scheduling: `ModelRunner.launch` writes them, the
        # next step's rows with `carried` >= 0 read them inside the graph).
        self.tokens = torch.zeros(self.buckets[-1], dtype=torch.long, device=device)
        self.static: dict[int, StaticBatch] = {}
        self.last: StaticBatch  # (the bucket the last `run` used)
        for b in self.buckets:
            self.static[b] = StaticBatch.make(b, max_blocks, device)
        self.replays = 0

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def _meta(self, s: StaticBatch) -> AttentionMetadata:
        width = s.tables.shape[1] * self.block_size
        mask = (torch.arange(width, device=self.device)[None, :] < s.context_lens[:, None]).view(s.size, 1, 1, -1)
        return AttentionMetadata(self.block_size, s.k_rows, s.k_rows + self.block_size, [],
                                 [DecodeBatch(0, s.tables, mask, s.context_lens)])

    def _input_ids(self, s: StaticBatch) -> torch.Tensor:
        """Each row's token: `input_ids`, or the last step's sample where `carried` points at one."""
        return torch.where(s.carried >= 0, self.tokens.index_select(0, s.carried.clamp(min=0)), s.input_ids)

    def _run(self, s: StaticBatch) -> None:
        out = self.forward(self._input_ids(s), s.positions, self._meta(s))
        if s.hidden is None:
            s.hidden = out
        else:
            s.hidden.copy_(out)

    def capture_order(self) -> list[StaticBatch]:
        """Largest bucket first: every graph records into one memory pool, where a smaller bucket's
        activations reuse the largest one's blocks, so the pool is about the largest bucket's peak
        (what `memory_profile` reserves before the KV cache is sized)."""
        return sorted(self.static.values(), key=lambda s: -s.size)

    def host_syncs(self, size: int) -> list[str]:
        """The host-syncing ops one padded forward of bucket `size` runs (empty: capturable)."""
        s = self.static[size]
        self._fill_padding(s, 0)
        probe = HostSyncProbe(self.device.type)
        with probe:
            self.forward(self._input_ids(s), s.positions, self._meta(s))
        return probe.seen

    def capture(self) -> None:
        """CUDA: check the forward holds no host sync, warm each bucket up, then record its graph into the
        shared pool. (CPU: nothing to record.)"""
        if self.device.type != "cuda":
            return
        pool = torch.cuda.graph_pool_handle()
        for s in self.capture_order():
            # Checked before each capture (a capture that fails mid-way can leave the CUDA context unusable).
            syncs = sorted(set(self.host_syncs(s.size)))
            if syncs:
                raise RuntimeError(f"the decode forward of a batch of {s.size} syncs with the host "
                                   f"({', '.join(syncs)}): it cannot be captured")
            self._fill_padding(s, 0)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._run(s)  # warm-up: kernels compiled/autotuned outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._run(s)
            s.graph = graph

    def _fill_padding(self, s: StaticBatch, n: int) -> None:
        bs = self.block_size
        s.input_ids[n:] = 0
        s.carried[n:] = -1
        s.positions[n:] = 0
        s.context_lens[n:] = 1
        s.tables[n:] = self.scratch_block
        s.k_rows[n:] = self.scratch_block * self.planes * bs  # slot 0 of the scratch block's K page

    def run(self, input_ids: list[int], positions: list[int], k_rows: list[int], tables: list[list[int]],
            context_lens: list[int], carried: list[int] | None = None,
            settings: list[tuple[float, float, float, float]] | None = None) -> torch.Tensor:
        """Hidden states [n, hidden] for n decode rows (n <= the largest bucket).

        The rows are written into the bucket's host mirror and sent in one copy. A table's entries past
        its own length keep whatever an earlier step left there (block ids, so always in range):
        attention reads only a row's first ceil(context / block_size) entries, the torch path masks the
        rest. Padding rows get context 1 in the scratch block. `carried`: per row, the index of its token
        in `self.tokens` or -1 — rows whose token the previous step sampled and the host has not read yet
        (async scheduling) take it from there inside the graph. `settings`: each row's sampling settings,
        sent with the inputs (`sampled_settings` reads them on the device)."""
        n = len(input_ids)
        b = self.bucket(n)
        assert b is not None, "batch larger than the largest bucket: run it eagerly"
        s = self.static[b]
        if s.copied is not None:
            s.copied.synchronize()  # (the previous step's copy out of this mirror was made)
        h = s.host_np
        h[0:n], h[b : b + n], h[2 * b : 2 * b + n], h[3 * b : 3 * b + n] = input_ids, positions, k_rows, context_lens
        h[n:b] = 0
        h[b + n : 2 * b] = 0
        h[2 * b + n : 3 * b] = self.scratch_block * self.planes * self.block_size  # slot 0 of the scratch K page
        h[3 * b + n : 4 * b] = 1
        if carried is not None:
            h[4 * b : 4 * b + n] = carried
            h[4 * b + n : 5 * b] = -1
        else:
            h[4 * b : 5 * b] = -1
        if settings is not None:
            h[5 * b : 5 * b + 4 * n] = np.asarray(settings, dtype=np.float32).view(np.int32).reshape(-1)
        width = s.tables.shape[1]
        t = h[9 * b :].reshape(b, width)
        for i, row in enumerate(tables):
            m = min(len(row), width)
            t[i, :m] = row[:m] if m < len(row) else row
        t[n:, 0] = self.scratch_block
        if s.host is not s.flat:
            s.flat.copy_(s.host, non_blocking=True)
            if s.copied is None:
                s.copied = torch.cuda.Event()
            s.copied.record()
        if s.graph is not None:
            s.graph.replay()  # type: ignore[attr-defined]
        else:
            self._run(s)
        self.replays += 1
        self.last = s
        assert s.hidden is not None and s.hidden.device.type == self.device.type
        return s.hidden[:n]

    def sampled_settings(self, n: int) -> torch.Tensor:
        """[n, 4] float32: the settings the last `run` sent for its rows."""
        return self.last.settings[:n].to(torch.int32).view(torch.float32)
