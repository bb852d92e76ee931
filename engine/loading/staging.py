"""Checkpoint bytes to an accelerator through a ring of pinned host buffers.

Copying a tensor read into ordinary (pageable) memory to a GPU is synchronous: the driver first
copies it into its own pinned bounce buffer, and the host cannot read the next tensor meanwhile,
so a load costs read time + copy time. Here the file is read straight into one of a few pinned
buffers, the copy to the device is queued asynchronously from it, and the host goes on reading
the next chunk into the next buffer while the DMA runs: load time approaches the read time
alone. A buffer is reused only after the event recorded behind its last copy has completed.

On CPU the same code runs with ordinary buffers and no-op events (tests force it there, with
small buffers so tensors span several chunks); `load_model` only stages for non-CPU devices,
since a CPU load reads straight into the parameter.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from common.errors import ModelLoadError
from engine.loading.device_events import Event, event_factory

BUFFER_BYTES = 32 * 2**20  # per buffer: large enough that a read call is cheap next to its bytes
BUFFERS = 2  # one being read into while the other's copy runs


class Staging:
    """One load's ring of buffers: `upload` per tensor, then `finish` before the buffers are dropped."""

    def __init__(self, device: torch.device, buffer_bytes: int = BUFFER_BYTES, buffers: int = BUFFERS,
                 make_event: Callable[[], Event] | None = None):
        if buffers < 1 or buffer_bytes < 16:
            raise ValueError(f"staging needs at least one buffer of 16 bytes (got {buffers} x {buffer_bytes})")
        pin = device.type == "cuda"
        self.device = device
        self.buffers = [torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(buffers)]
        self.pending: list[Event | None] = [None] * buffers
        self.make_event = make_event or event_factory(device)
        self._next = 0
        self.uploads = 0
        self.chunks = 0
        self.bytes = 0

    def upload(self, path: str, offset: int, nbytes: int, src_dtype: torch.dtype, dst: torch.Tensor) -> None:
        """`dst` (contiguous, any device) <- the `nbytes` of `src_dtype` elements at `offset` in `path`,
        converted to dst's dtype on the device. Returns once every chunk is read and its copy queued."""
        if not dst.is_contiguous():
            raise ValueError("staging uploads into contiguous tensors only")
        elem = src_dtype.itemsize
        flat = dst.view(-1)
        if nbytes != flat.numel() * elem:
            raise ModelLoadError(f"{path}: {nbytes} bytes at {offset} do not fill a tensor of {flat.numel()} elements")
        per = self.buffers[0].numel() // elem
        self.uploads += 1
        with open(path, "rb") as f:
            for start in range(0, flat.numel(), per):
                n = min(per, flat.numel() - start)
                i = self._take()
                raw = self.buffers[i][: n * elem]
                f.seek(offset + start * elem)
                got = f.readinto(memoryview(raw.numpy()))
                if got != n * elem:
                    raise ModelLoadError(f"{path}: truncated at byte {offset + start * elem + (got or 0)}")
                src = raw.view(src_dtype)
                if src_dtype == dst.dtype:
                    flat[start : start + n].copy_(src, non_blocking=True)
                else:  # (to the device as stored, then converted there: a host-side cast would block)
                    flat[start : start + n].copy_(src.to(dst.device, non_blocking=True))
                ev = self.make_event()
                ev.record()
                self.pending[i] = ev
                self.chunks += 1
                self.bytes += n * elem

    def _take(self) -> int:
        """The next buffer in the ring, once the copy last queued from it has run."""
        i = self._next
        self._next = (i + 1) % len(self.buffers)
        ev = self.pending[i]
        if ev is not None:
            ev.synchronize()
            self.pending[i] = None
        return i

    def finish(self) -> None:
        """Wait for every queued copy (before the buffers may be freed or the tensors used elsewhere)."""
        for i, ev in enumerate(self.pending):
            if ev is not None:
                ev.synchronize()
                self.pending[i] = None
