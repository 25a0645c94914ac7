"""One submitted request, as the client library hands it to the caller: its progress and
partial images as streams, its result, its cancel. Thread-safe: the client's IO thread
fills it in (`_deliver`, `_finish`); any thread may wait on it."""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable, Iterator

from engine.protocol import Accepted, Cancel, Canceled, Completed, Failed, PartialImage, Progress, Rejected

log = logging.getLogger("diffslot.client")

Result = Completed | Canceled | Rejected | Failed
_END = object()  # closes a handle's progress stream


class RequestHandle:
    """One submitted request. Thread-safe; results are filled in by the client's IO thread."""

    def __init__(self, send_soon: Callable[[Any], None], request_id: str):
        """`send_soon`: queues a message for the client's IO thread to send (a cancel)."""
        self.request_id = request_id
        self.submitted_at = time.monotonic()
        self.accepted_at: float | None = None  # when Accepted arrived (client clock)
        self._send_soon = send_soon
        self._progress: queue.SimpleQueue = queue.SimpleQueue()
        self._partials: queue.SimpleQueue = queue.SimpleQueue()
        self._partial_callbacks: list[Callable[[PartialImage], None]] = []
        self._accepted: Accepted | None = None
        self._accepted_event = threading.Event()
        self._done = threading.Event()
        self._result: Result | None = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[RequestHandle], None]] = []
        self._lock = threading.Lock()
        self.partial_images_received = 0  # written by the IO thread only

    def progress(self, timeout: float | None = None) -> Iterator[Progress]:
        """Progress(step, total) after each denoising step, until the request ends.
        Raises EngineDeadError if the engine dies meanwhile, TimeoutError if nothing
        arrives within `timeout` seconds."""
        return self._stream(self._progress, "progress", timeout)

    def partial_images(self, timeout: float | None = None) -> Iterator[PartialImage]:
        """The partial images asked for at submit (`PartialImage(index, step, total)` with
        `.image`, PNG bytes of the decoded clean-image estimate), until the request ends."""
        return self._stream(self._partials, "partial image", timeout)

    def _stream(self, items: queue.SimpleQueue, what: str, timeout: float | None):
        while True:
            try:
                item = items.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no {what} on request {self.request_id} within {timeout}s") from None
            if item is _END:
                if self._error is not None:
                    raise self._error
                return
            yield item

    def on_partial_image(self, fn: Callable[[PartialImage], None]) -> None:
        """Call fn(partial image) as each arrives (on the client's IO thread)."""
        self._partial_callbacks.append(fn)

    def result(self, timeout: float | None = None) -> Result:
        """Completed | Canceled | Rejected | Failed. Raises EngineDeadError if the
        engine died first, TimeoutError if `timeout` passes (the request goes on)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} not finished within {timeout}s")
        if self._error is not None:
            raise self._error
        return self._result

    def accepted(self, timeout: float | None = None) -> Accepted | None:
        """Wait until the engine accepted the request; None if it ended without (Rejected)."""
        if not self._accepted_event.wait(timeout):
            raise TimeoutError(f"request {self.request_id} not accepted within {timeout}s")
        if self._accepted is None and self._error is not None:
            raise self._error
        return self._accepted

    def cancel(self) -> None:
        """Ask the engine to cancel; the result becomes Canceled unless it already finished.
        Idempotent, and safe to race with completion."""
        if not self._done.is_set():
            self._send_soon(Cancel(self.request_id))

    def done(self) -> bool:
        return self._done.is_set()

    def add_done_callback(self, fn: Callable[["RequestHandle"], None]) -> None:
        """Call fn(handle) when the request ends (on the client's IO thread, or now)."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    # ------------------------------------------------------------ IO thread side
    def _deliver(self, msg) -> None:
        if isinstance(msg, Progress):
            self._progress.put(msg)
        elif isinstance(msg, PartialImage):
            self.partial_images_received += 1
            self._partials.put(msg)
            for fn in self._partial_callbacks:
                try:
                    fn(msg)
                except Exception:
                    log.exception("partial image callback of request %s failed", self.request_id)
        elif isinstance(msg, Accepted):
            self._accepted, self.accepted_at = msg, time.monotonic()
            self._accepted_event.set()
        else:
            self._finish(msg, None)

    def _finish(self, result: Result | None, error: BaseException | None) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self._result, self._error = result, error
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        self._accepted_event.set()
        self._progress.put(_END)
        self._partials.put(_END)
        for fn in callbacks:
            try:
                fn(self)
            except Exception:
                log.exception("done callback of request %s failed", self.request_id)
