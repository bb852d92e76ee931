"""The collectives a tensor-parallel group runs (`parallel.Shard`): all-reduce and all-gather.

`ProcessGroupCollectives` is the reference: a torch.distributed process group made for this group
alone (gloo on CPU, NCCL on CUDA). On one CPU host gloo's TCP round trips cost about 1.5 ms per
collective on this project's 2-core machine whatever the size (a random 8-layer Llama's decode step
waited 26 of its 48 ms in 18 of them), so `SharedMemoryCollectives` does the same through a shared
memory segment: each rank copies its tensor into its slot, says so with a sequence number, waits for
every rank's, and sums (or concatenates) the slots in rank order — the same order on every rank, so
every rank gets the same bits, as with gloo's ring. Two sets of slots alternate: a rank can be at most
one collective ahead of the slowest, so it never overwrites a slot another rank is still reading.
A tensor larger than a slot goes through the process group instead (every rank sees the same size,
so they all take the same path). `tests/test_tensor_parallel.py` holds the two equal.

Memory order: the slot is written before the sequence number, and read after it is seen; x86's
stores are not reordered with each other nor loads with loads (TSO). On other CPUs the shared-memory
path is not used.
"""

from __future__ import annotations

import os
import platform
from multiprocessing import shared_memory
from typing import Any, Protocol

import numpy as np
import torch

SPINS_BEFORE_YIELD = 2000  # then give the core away between checks (more ranks than cores)


class Collectives(Protocol):
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, x: torch.Tensor) -> torch.Tensor: ...


class ProcessGroupCollectives:
    """Through a torch.distributed ProcessGroup object (the group's own, not the global one)."""

    def __init__(self, group: Any, size: int):
        self.group = group
        self.size = size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.group.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=-1)


def shared_memory_supported() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


class SharedMemoryCollectives:
    """Ranks of one CPU host: slots in a shared memory segment, `fallback` for tensors that do not fit."""

    HEADER = 64  # bytes per rank's sequence number (a cache line each: no false sharing)

    def __init__(self, name: str, rank: int, size: int, slot_bytes: int, fallback: Collectives, create: bool):
        self.rank, self.size, self.slot_bytes, self.fallback = rank, size, slot_bytes, fallback
        total = self.HEADER * size + 2 * size * slot_bytes
        self.shm = (shared_memory.SharedMemory(name=name, create=True, size=total) if create
                    else shared_memory.SharedMemory(name=name))
        if not create:  # (an attaching process must not unlink the segment when it exits: rank 0 owns it)
            from multiprocessing import resource_tracker

            resource_tracker.unregister(self.shm._name, "shared_memory")  # type: ignore[attr-defined]
        if create:
            self.shm.buf[: self.HEADER * size] = bytes(self.HEADER * size)
        self.seqs = np.ndarray((size, self.HEADER // 8), dtype=np.int64, buffer=self.shm.buf)[:, 0]
        self.data = torch.frombuffer(self.shm.buf, dtype=torch.uint8, offset=self.HEADER * size,
                                     count=2 * size * slot_bytes)
        self.seq = 0
        self.owner = create

    def _slot(self, half: int, rank: int, x: torch.Tensor) -> torch.Tensor:
        start = (half * self.size + rank) * self.slot_bytes
        n = x.numel() * x.element_size()
        return self.data[start : start + n].view(x.dtype).view(x.shape)

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `x` (this one's included), in rank order, once all have written theirs."""
        self.seq += 1
        half = self.seq % 2
        self._slot(half, self.rank, x).copy_(x)
        self.seqs[self.rank] = self.seq
        spins = 0
        while (self.seqs < self.seq).any():
            spins += 1
            if spins > SPINS_BEFORE_YIELD:
                os.sched_yield()
        return [self._slot(half, r, x) for r in range(self.size)]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() * x.element_size() > self.slot_bytes or not x.is_contiguous():
            return self.fallback.all_reduce(x)
        parts = self._exchange(x)
        torch.add(parts[0], parts[1], out=x)
        for p in parts[2:]:
            x.add_(p)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() * x.element_size() > self.slot_bytes:
            return self.fallback.all_gather(x)
        return torch.cat(self._exchange(x.contiguous()), dim=-1)

    def close(self) -> None:
        del self.data, self.seqs
        self.shm.close()
        if self.owner:
            self.shm.unlink()


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32]


class SharedMemoryChannel:
    """One-way tensors from one rank to another through shared memory (pipeline stages' hand-offs and
    the last stage's logits): two slots alternate, each with a header naming its tensors' dtypes and
    shapes; the sender waits until the receiver has read the slot it is about to reuse."""

    HEADER = 512  # bytes: sequence numbers, then the tensors' descriptions

    def __init__(self, name: str, slot_bytes: int, create: bool):
        self.slot_bytes = slot_bytes
        total = 128 + 2 * (self.HEADER + slot_bytes)
        self.shm = (shared_memory.SharedMemory(name=name, create=True, size=total) if create
                    else shared_memory.SharedMemory(name=name))
        if create:
            self.shm.buf[:128] = bytes(128)
        else:
            from multiprocessing import resource_tracker

            resource_tracker.unregister(self.shm._name, "shared_memory")  # type: ignore[attr-defined]
        # [written, read]: sequence numbers, a cache line apart
        self.seqs = np.ndarray((2, 8), dtype=np.int64, buffer=self.shm.buf)[:, 0]
        self.owner = create
        self.sent = self.received = 0

    def _slot(self, k: int) -> tuple[memoryview, int]:
        start = 128 + k * (self.HEADER + self.slot_bytes)
        return self.shm.buf, start

    def _wait(self, index: int, at_least: int) -> None:
        spins = 0
        while self.seqs[index] < at_least:
            spins += 1
            if spins > SPINS_BEFORE_YIELD:
                os.sched_yield()

    def send(self, tensors: list[torch.Tensor]) -> None:
        size = sum(t.numel() * t.element_size() for t in tensors)
        if size > self.slot_bytes or len(tensors) > 8:
            raise RuntimeError(f"pipeline hand-off of {size} bytes exceeds its {self.slot_bytes}-byte slot")
        self.sent += 1
        self._wait(1, self.sent - 2)  # the receiver has read what this slot held last time
        buf, start = self._slot(self.sent % 2)
        desc = np.ndarray((self.HEADER // 8,), dtype=np.int64, buffer=buf, offset=start)
        desc[0] = len(tensors)
        data = start + self.HEADER
        for i, t in enumerate(tensors):
            t = t.contiguous()
            desc[1 + i * 6 : 1 + i * 6 + 6] = [_DTYPES.index(t.dtype), t.dim(), *list(t.shape) + [0] * (4 - t.dim())]
            n = t.numel() * t.element_size()
            torch.frombuffer(buf, dtype=torch.uint8, offset=data, count=n).copy_(t.view(-1).view(torch.uint8))
            data += n
        self.seqs[0] = self.sent

    def free(self) -> bool:
        """A `send` now would not wait (the receiver has read the slot it would reuse)."""
        return bool(self.seqs[1] >= self.sent + 1 - 2)

    def ready(self) -> bool:
        """A `recv` now would not wait."""
        return bool(self.seqs[0] >= self.received + 1)

    def recv(self) -> list[torch.Tensor]:
        self.received += 1
        self._wait(0, self.received)
        buf, start = self._slot(self.received % 2)
        desc = np.ndarray((self.HEADER // 8,), dtype=np.int64, buffer=buf, offset=start)
        out, data = [], start + self.HEADER
        for i in range(int(desc[0])):
            code, ndim, *dims = (int(v) for v in desc[1 + i * 6 : 1 + i * 6 + 6])
            dtype, shape = _DTYPES[code], tuple(dims[:ndim])
            n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size() if shape else 0
            out.append(torch.frombuffer(buf, dtype=torch.uint8, offset=data, count=n).clone().view(dtype).view(shape)
                       if n else torch.empty(shape, dtype=dtype))
            data += n
        self.seqs[1] = self.received
        return out

    def close(self) -> None:
        del self.seqs
        self.shm.close()
        if self.owner:
            self.shm.unlink()
