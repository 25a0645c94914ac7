"""The step watchdog: a `core.step()` that runs longer than `--step-timeout`
ends the engine, so a supervisor (systemd, Kubernetes) restarts it.

The busy loop stamps the start and end of every step on its heartbeat
(engine.serve.heartbeat). A daemon thread looks at the stamp every
`min(1 s, timeout / 4)`. When a step has run past the timeout it calls `on_hang`
(the engine process tells every client `EngineDead` from its IO thread, kills its
decode workers, removes its shared memory and ipc socket, and `os._exit`s non-zero)
while the main thread is still stuck.

That needs the GIL. A step stuck in C code that holds the GIL starves every Python
thread, this one included; for that case the busy loop keeps a backstop armed that
needs no GIL: `faulthandler.dump_traceback_later(exit=True)`, a C thread that dumps
every thread's stack to stderr and `_exit(1)`s. `arm` (at each step's start) re-arms it for
now + timeout + grace when it was armed more than grace / 2 ago (so at most one
re-arm, one thread start, every few seconds, however short the steps), and `idle`
disarms it when the loop waits for work; it fires between step start + timeout +
grace / 2 and step start + timeout + grace. Clients then learn of the death from
the missed heartbeats (`peer_timeout_s`), and the next engine start sweeps the
shared memory the dead one left.
"""
from __future__ import annotations

import faulthandler
import logging
import sys
import threading
import time
import traceback
from typing import Callable

from engine.serve.heartbeat import LoopHeartbeat

log = logging.getLogger("diffslot.engine")


class StepWatchdog(threading.Thread):
    def __init__(self, heartbeat: LoopHeartbeat, timeout_s: float, on_hang: Callable[[str], None], *,
                 grace_s: float | None = None, backstop: bool = True):
        super().__init__(name="diffslot-watchdog", daemon=True)
        self.heartbeat = heartbeat
        self.timeout_s = float(timeout_s)
        self.grace_s = grace_s if grace_s is not None else max(5.0, self.timeout_s / 4)
        self.on_hang = on_hang
        self.backstop = backstop
        self.interval_s = max(0.05, min(1.0, self.timeout_s / 4))
        self._stop = threading.Event()
        self._armed_at: float | None = None  # when the busy loop last armed the backstop

    # -------------------------------------------------- busy loop side (cheap)
    def arm(self) -> None:
        """A step starts: make sure the backstop would end it if the GIL never comes back."""
        now = time.monotonic()
        if self.backstop and (self._armed_at is None or now - self._armed_at > self.grace_s / 2):
            faulthandler.dump_traceback_later(self.timeout_s + self.grace_s, exit=True, file=sys.stderr)
            self._armed_at = now

    def idle(self) -> None:
        """The busy loop is about to wait for work: no step can hang meanwhile."""
        if self._armed_at is not None:
            faulthandler.cancel_dump_traceback_later()
            self._armed_at = None

    # -------------------------------------------------- watchdog thread
    def stop(self) -> None:
        """From the busy loop's thread, at shutdown."""
        self._stop.set()
        self.idle()

    def run(self) -> None:
        main_ident = threading.main_thread().ident
        while not self._stop.wait(self.interval_s):
            started = self.heartbeat.step_started
            if started is None:
                continue
            ran = time.monotonic() - started
            if ran > self.timeout_s and self.heartbeat.step_started == started:
                frame = sys._current_frames().get(main_ident)
                where = "".join(traceback.format_stack(frame)[-6:]) if frame is not None else "(unknown)"
                reason = (f"engine step hung: core.step() running for {ran:.1f}s, past the step timeout of "
                          f"{self.timeout_s:g}s (--step-timeout); the engine exits so its supervisor restarts it")
                log.critical("%s; the busy loop is at:\n%s", reason, where)
                self.on_hang(reason)
                return
