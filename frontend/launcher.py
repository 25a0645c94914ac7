"""Starting an engine process and stopping it: one launcher for the demo, the tests and
the benchmarks.

`EngineProcess` runs a command (by default `python -m engine serve`), waits until a
client completes the handshake, and on `stop()` sends SIGTERM (the engine drains), a
second SIGTERM after a timeout (it stops at once), then SIGKILL, and reaps it. `launched_engine` is the same as a context manager that yields a
connected `Client`; a SIGTERM to the launching process unwinds through it, so the
engine is never orphaned.
"""
from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import time


def serve_command(address: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "engine", "serve", "--address", address, *args]


def stop_process(process: subprocess.Popen, timeout: float = 30.0) -> int:
    """SIGTERM (an engine drains what is in flight), a second SIGTERM after `timeout`
    (an engine stops at once, cleaning up), SIGKILL 10 s later; always reaped.
    Returns the exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    return process.returncode


class EngineProcess:
    """An engine subprocess whose stderr goes to `log_path`."""

    def __init__(self, command: list[str], address: str, log_path: pathlib.Path, *,
                 env: dict | None = None, cwd: str | os.PathLike | None = None, new_session: bool = False):
        self.address = address
        self.log_path = pathlib.Path(log_path)
        self._log = open(self.log_path, "wb")
        self.popen = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=self._log,
                                      start_new_session=new_session)
        self.pid = self.popen.pid

    def connect(self, timeout: float = 60.0):
        """A connected `frontend.Client`, once the engine answers its handshake."""
        from frontend import Client

        deadline = time.monotonic() + timeout
        while True:
            if self.popen.poll() is not None:
                raise RuntimeError(f"engine exited with {self.popen.returncode} before it was ready:\n{self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine not ready within {timeout:g}s:\n{self.log()}")
            client = Client(self.address, connect_timeout=1.0)
            try:
                client.connect()
                return client
            except ConnectionError:
                pass

    def wait_ready(self, timeout: float = 60.0) -> None:
        self.connect(timeout).close()

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self, timeout: float = 20.0) -> int:
        code = stop_process(self.popen, timeout)
        self._log.close()
        return code


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def launched_engine(command: list[str], address: str, log_path: pathlib.Path, ready_timeout: float = 180.0):
    """Run an engine process, yield (process, connected Client); SIGTERM and reap it after."""
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    engine = EngineProcess(command, address, log_path, new_session=True)
    client = None
    try:
        client = engine.connect(ready_timeout)
        yield engine.popen, client
    finally:
        if client is not None:
            client.close()
        engine.stop(30.0)
