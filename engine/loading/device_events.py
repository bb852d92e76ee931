"""Completion markers for work queued on a device, with a no-op stand-in on CPU.

Two places hand device work to someone who must not touch its result (or its inputs) early: the
prefill worker's layer-wise KV sender and the checkpoint loader's pinned staging buffers. Both
record an event where the work was queued and wait on it later; on CPU the work is done when the
call returns, so the same code runs with `NoEvent` and every CPU test exercises it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class Event(Protocol):
    def record(self) -> None: ...

    def synchronize(self) -> None: ...


class NoEvent:
    """CPU: work is complete when the Python call that queued it returns."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


def event_factory(device: torch.device) -> Callable[[], Event]:
    if device.type == "cuda":
        return lambda: torch.cuda.Event()  # records on the current stream
    return NoEvent
