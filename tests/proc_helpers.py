"""Helpers for multi-process tests of the engine process, protocol and client.

Every process started here is reaped by the context manager that started it, and
ipc sockets live in short private directories (unix socket paths are limited to
about 107 bytes, which pytest's tmp_path can exceed).
"""
from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import msgspec
import zmq

REPO = pathlib.Path(__file__).resolve().parent.parent
FAKE_CORE = REPO / "tests" / "fake_core.py"
sys.path.insert(0, str(REPO))

from engine.protocol import PROTOCOL_VERSION, Heartbeat, Hello, encoder, engine_decoder  # noqa: E402


@contextlib.contextmanager
def socket_dir():
    path = pathlib.Path(tempfile.mkdtemp(prefix="dst-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def env() -> dict:
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join([str(REPO), environment.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    environment.setdefault("OMP_NUM_THREADS", "1")  # tests run beside other work: stay modest
    return environment


class EngineProcess:
    """An engine subprocess: `fake=True` runs tests/fake_core.py, else `python -m engine serve`."""

    def __init__(self, address: str, log_path: pathlib.Path, args: list[str], fake: bool = True):
        self.address = address
        self.log_path = log_path
        if fake:
            command = [sys.executable, str(FAKE_CORE), "--address", address, *args]
        else:
            command = [sys.executable, "-m", "engine", "serve", "--address", address, *args]
        self._log = open(log_path, "wb")
        self.popen = subprocess.Popen(command, cwd=REPO, env=env(), stdout=subprocess.DEVNULL, stderr=self._log)
        self.pid = self.popen.pid

    def wait_ready(self, timeout: float = 60.0) -> None:
        from frontend import Client

        deadline = time.monotonic() + timeout
        while True:
            if self.popen.poll() is not None:
                raise RuntimeError(f"engine exited with {self.popen.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine not ready in {timeout}s:\n{self.log()}")
            try:
                with Client(self.address, connect_timeout=0.5):
                    return
            except ConnectionError:
                pass

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self, timeout: float = 20.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._log.close()
        return self.popen.returncode


@contextlib.contextmanager
def fake_engine(*args: str, ready_timeout: float = 60.0):
    """A FakeCore engine on a fresh ipc socket; stopped (SIGTERM, then SIGKILL) and reaped after."""
    with socket_dir() as directory:
        engine = EngineProcess(f"ipc://{directory / 'engine.sock'}", directory / "engine.log", list(args))
        try:
            engine.wait_ready(ready_timeout)
            yield engine
        finally:
            engine.stop()


@contextlib.contextmanager
def real_engine(*args: str, ready_timeout: float = 180.0):
    with socket_dir() as directory:
        engine = EngineProcess(f"ipc://{directory / 'engine.sock'}", directory / "engine.log",
                               ["--device", "cpu", *args], fake=False)
        try:
            engine.wait_ready(ready_timeout)
            yield engine
        finally:
            engine.stop()


@contextlib.contextmanager
def client_process(code: str, *args: str):
    """A Python subprocess running `code` (dedented) with `args` in sys.argv[1:]; killed
    and reaped after. Its stdout is a pipe: the test reads lines the script prints."""
    popen = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], cwd=REPO, env=env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield popen
    finally:
        if popen.poll() is None:
            popen.kill()
        popen.communicate(timeout=30)


def read_line(popen: subprocess.Popen, timeout: float = 30.0) -> str:
    """One stdout line of a child, or fail with its stderr."""
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(popen.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise TimeoutError("child printed nothing")
    line = popen.stdout.readline()
    if not line:
        raise RuntimeError(f"child exited ({popen.wait()}): {popen.stderr.read()}")
    return line.strip()


def shm_leftovers(pid: int) -> list[str]:
    if not os.path.isdir("/dev/shm"):
        return []
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"diffslot-{pid}")]


def wait_until(predicate, timeout: float, interval: float = 0.05, message: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{message} not reached within {timeout}s")
        time.sleep(interval)


class RawPeer:
    """A hand-driven DEALER speaking the wire protocol, for malformed frames and slow readers."""

    def __init__(self, address: str, rcvhwm: int = 1000, hello: bool = True):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.encoder = encoder()
        self.decoder = engine_decoder()
        if hello:
            self.send(Hello(PROTOCOL_VERSION, os.getpid(), "raw"))
            welcome = self.recv(10)
            assert type(welcome).__name__ == "Welcome", welcome

    def send(self, msg) -> None:
        self.sock.send(self.encoder.encode(msg))

    def send_frames(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def heartbeat(self) -> None:
        self.send(Heartbeat())

    def recv(self, timeout: float = 5.0, skip_heartbeats: bool = True):
        """The next message (payload frames attached as `.frames` on Completed)."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self.sock.poll(remaining * 1000):
                raise TimeoutError("no message from the engine")
            frames = self.sock.recv_multipart()
            msg = self.decoder.decode(frames[0])
            if skip_heartbeats and isinstance(msg, Heartbeat):
                continue
            if len(frames) > 1:
                msg.frames = frames[1:]
            return msg

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def encode_raw(obj) -> bytes:
    return msgspec.msgpack.encode(obj)
