"""The layer-wise KV sender waits on each layer's event on its own thread, never on the compute
thread, and submits layers in order only after their events fired."""

from __future__ import annotations

import threading
import time
from typing import ClassVar

import pytest

from worker.kv.layer_events import LayerEvents


class FakeEvent:
    """Completes `delay` seconds after it is recorded, like a GPU event behind queued kernels."""

    log: ClassVar[list[tuple[str, int, str]]] = []

    def __init__(self, layer: int, delay: float):
        self.layer, self.delay = layer, delay
        self.recorded_at = 0.0

    def record(self) -> None:
        self.recorded_at = time.monotonic()
        self.log.append(("record", self.layer, threading.current_thread().name))

    def synchronize(self) -> None:
        time.sleep(max(self.recorded_at + self.delay - time.monotonic(), 0))
        self.log.append(("wait", self.layer, threading.current_thread().name))


def test_layers_are_submitted_after_their_event_and_in_order_off_the_compute_thread():
    FakeEvent.log = []
    layers = iter(range(100))
    events = LayerEvents(lambda: FakeEvent(next(layers), delay=0.02))
    submitted: list[tuple[int, str, float]] = []
    t0 = time.monotonic()
    for layer in range(4):
        events.layer_done(lambda layer=layer: submitted.append((layer, threading.current_thread().name,
                                                                 time.monotonic())))
    handed_over = time.monotonic() - t0
    events.drain()
    compute = threading.current_thread().name
    assert handed_over < 0.02  # the compute thread never waited for an event
    assert [s[0] for s in submitted] == [0, 1, 2, 3]
    assert all(name != compute for _, _, name in [e for e in FakeEvent.log if e[0] == "wait"])
    assert all(name != compute for _, name, _ in submitted)
    for layer, _, at in submitted:  # each submit after its own event completed
        waited = [i for i, e in enumerate(FakeEvent.log) if e[:2] == ("wait", layer)]
        assert waited and at - t0 >= 0.02
    events.close()


def test_a_failed_submit_is_raised_by_drain_and_later_layers_are_not_sent():
    events = LayerEvents(lambda: FakeEvent(0, 0.0))
    sent = []

    def boom() -> None:
        raise ConnectionError("segment gone")

    events.layer_done(boom)
    events.layer_done(lambda: sent.append(1))
    with pytest.raises(RuntimeError, match="segment gone"):
        events.drain()
    assert sent == []
    events.layer_done(lambda: sent.append(2))  # the next step sends again
    events.drain()
    assert sent == [2]
    events.close()
