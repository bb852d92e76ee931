"""Layer-wise KV sends without draining the GPU: the compute stream records an event after each
layer; a sender thread waits on that event, then submits the layer's writes.

Before this, the prefill worker called `torch.cuda.current_stream().synchronize()` after every
layer, so the CPU could not queue layer i+1's kernels until layer i had finished: a pipeline
drain per layer. Now the engine thread only records an event (microseconds) and keeps launching;
the wait happens on the sender thread. On CPU the event is a no-op (the layer's K/V are in memory
when the layer returns) and the same thread and queue run, so every CPU test exercises this path.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from engine.loading.device_events import Event, NoEvent, event_factory

__all__ = ["Event", "LayerEvents", "NoEvent", "event_factory"]


class LayerEvents:
    """One sender thread per worker; `layer_done` from the engine thread, `drain` before reading results."""

    def __init__(self, make_event: Callable[[], Event]):
        self.make_event = make_event
        self._q: queue.Queue[tuple[Event, Callable[[], None]] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-layer-sender", daemon=True)
        self._thread.start()

    def layer_done(self, submit: Callable[[], None]) -> None:
        """The layer's kernels are queued: record where, and let the sender submit once they ran."""
        ev = self.make_event()
        ev.record()
        self._q.put((ev, submit))

    def drain(self) -> None:
        """Block until every layer handed over so far has been submitted; re-raise a sender failure."""
        self._q.join()
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"layer-wise KV sender failed: {err}") from err

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(5)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                ev, submit = item
                if self._error is None:  # after a failure, later layers of the step are not sent
                    ev.synchronize()
                    submit()
            except BaseException as e:  # handed to the engine thread by drain(), not swallowed
                self._error = e
            finally:
                self._q.task_done()
