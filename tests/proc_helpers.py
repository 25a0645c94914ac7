"""Helpers for multi-process tests of the engine process, protocol and client.

Every process started here is reaped by the context manager that started it, and
ipc sockets live in short private directories (unix socket paths are limited to
about 107 bytes, which pytest's tmp_path can exceed).

Fake engines run through this file (`python tests/proc_helpers.py fake ...`): the
FakeCore of tests/fake_core.py behind the real engine process, with the engine
process's own flags (engine.serve.options) on top of the fake's. Faults are injected
by wrapping the core (`FaultyCore`), configured through the DIFFSLOT_TEST_FAULTS
environment variable (JSON), for the fake core and for the real one
(`python -m engine serve --core tests.proc_helpers:faulty_core`).
"""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import msgspec
import zmq

REPO = pathlib.Path(__file__).resolve().parent.parent
FAKE_CORE = REPO / "tests" / "fake_core.py"

from engine.protocol import PROTOCOL_VERSION, SEGMENT_PREFIX, Heartbeat, Hello, encoder, engine_decoder  # noqa: E402
from frontend import launcher  # noqa: E402


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


FAULTS_ENV = "DIFFSLOT_TEST_FAULTS"


def start_engine(address: str, log_path: pathlib.Path, args: list[str], fake: bool = True, *,
                 faults: dict | None = None, new_session: bool = False,
                 extra_env: dict | None = None) -> launcher.EngineProcess:
    """An engine subprocess: `fake=True` runs FakeCore (tests/fake_core.py) behind the engine
    process, else `python -m engine serve`. `faults` (see FaultyCore) wraps the core;
    `new_session`: its own process group (the engine's pid), as a container's."""
    environment = env()
    environment.update(extra_env or {})
    if faults:
        environment[FAULTS_ENV] = json.dumps(faults)
        if not fake:
            args = ["--core", "tests.proc_helpers:faulty_core", *args]
    command = [sys.executable, str(pathlib.Path(__file__).resolve()), "fake", "--address", address, *args] if fake \
        else launcher.serve_command(address, *args)
    return launcher.EngineProcess(command, address, log_path, env=environment, cwd=REPO, new_session=new_session)


@contextlib.contextmanager
def fake_engine(*args: str, ready_timeout: float = 60.0, faults: dict | None = None, stop_timeout: float = 20.0):
    """A FakeCore engine on a fresh ipc socket; stopped (SIGTERM, then SIGKILL) and reaped after."""
    with socket_dir() as directory:
        engine = start_engine(f"ipc://{directory / 'engine.sock'}", directory / "engine.log", list(args),
                              faults=faults)
        try:
            engine.wait_ready(ready_timeout)
            yield engine
        finally:
            engine.stop(stop_timeout)


@contextlib.contextmanager
def real_engine(*args: str, ready_timeout: float = 180.0, faults: dict | None = None, new_session: bool = False,
                stop_timeout: float = 20.0, extra_env: dict | None = None):
    """`python -m engine serve --device cpu *args` on a fresh ipc socket (`extra_env`: more
    environment); stopped (SIGTERM, then SIGKILL) and reaped after."""
    with socket_dir() as directory:
        engine = start_engine(f"ipc://{directory / 'engine.sock'}", directory / "engine.log",
                              ["--device", "cpu", *args], fake=False, faults=faults, new_session=new_session,
                              extra_env=extra_env)
        try:
            engine.wait_ready(ready_timeout)
            yield engine
        finally:
            engine.stop(stop_timeout)


# --------------------------------------------------------------------- fault injection

class FaultyCore:
    """Wraps a core (CoreInterface) to inject faults by prompt:

    - `hang_prompt`: once a request with this prompt is added, the busy loop hangs for
      `hang_s` — in step() (`hang_where` "step") or in add_request itself ("add_request",
      a stall outside any step, which the step watchdog does not see) — `hang_mode`
      "sleep" (blocked in C code without the GIL, as a stuck device sync) or "gil" (a
      regular expression that backtracks for ever while holding the GIL). A step hang
      happens once.
    - `raise_prompt`: step() raises once such a request was added (an unguarded core bug).
    Everything else is the wrapped core's."""

    def __init__(self, core, hang_prompt: str | None = None, hang_mode: str = "sleep", hang_s: float = 3600.0,
                 hang_where: str = "step", raise_prompt: str | None = None):
        self._core = core
        self._hang_prompt, self._hang_mode, self._hang_s, self._hang_where = hang_prompt, hang_mode, hang_s, hang_where
        self._raise_prompt = raise_prompt
        self._armed: str | None = None

    def add_request(self, request_id, params, arrival_time=None, partial_images=0):
        self._core.add_request(request_id, params, arrival_time=arrival_time, partial_images=partial_images)
        if params.prompt == self._hang_prompt:
            if self._hang_where == "add_request":
                self._hang()
            else:
                self._armed = "hang"
        elif params.prompt == self._raise_prompt:
            self._armed = "raise"

    def step(self):
        outputs = self._core.step()
        if self._armed == "raise":
            raise RuntimeError("injected core failure (FaultyCore.raise_prompt)")
        if self._armed == "hang":
            self._armed = None
            self._hang()
        return outputs

    def _hang(self) -> None:
        if self._hang_mode == "gil":
            import re

            re.match(r"(a+)+$", "a" * 64 + "b")  # exponential backtracking inside the GIL
        time.sleep(self._hang_s)

    def __getattr__(self, name):
        return getattr(self._core, name)


def _faults() -> dict:
    return json.loads(os.environ.get(FAULTS_ENV) or "{}")


def _wrap(core):
    faults = {k: v for k, v in _faults().items() if k != "poison_prompt"}
    return FaultyCore(core, **faults) if faults else core


POISON_MARK = 12345.0  # written into a poisoned prompt's embedding, where the denoiser looks for it


def poison_model(model, prompt: str):
    """Make the real model's denoiser raise for any batch holding a row conditioned on
    `prompt` (a poison request): the model's encoder marks that prompt's embedding rows,
    and the denoiser refuses a batch whose prompt rows carry the mark, as a denoiser
    that cannot take some input would. The core must fail that request alone."""
    encode, run = model.encode, model.run

    def marking_encode(prompts):
        rows = encode(prompts)
        for text, row in zip(prompts, rows):
            if text == prompt:
                row.hidden = row.hidden.clone()
                row.hidden.reshape(-1)[0] = POISON_MARK
        return rows

    def refusing_run(inputs):
        first = inputs.hidden.reshape(inputs.rows, -1)[:, 0]
        if bool((first == POISON_MARK).any()):
            raise ValueError(f"injected denoiser failure: cannot take the prompt {prompt!r}")
        return run(inputs)

    model.encode, model.run = marking_encode, refusing_run
    return model


def faulty_core(model, config):
    """`python -m engine serve --core tests.proc_helpers:faulty_core`: the real EngineCore,
    wrapped as DIFFSLOT_TEST_FAULTS says (`poison_prompt` poisons the model's denoiser)."""
    from engine.core import EngineCore

    if _faults().get("poison_prompt"):
        model = poison_model(model, _faults()["poison_prompt"])
    return _wrap(EngineCore(model, config))


def fake_main(argv: list[str]) -> int:
    """tests/fake_core.py's engine, its core wrapped by FaultyCore as DIFFSLOT_TEST_FAULTS says,
    giving up sooner than a production engine (step and drain timeouts)."""
    sys.path.insert(0, str(REPO / "tests"))
    import fake_core

    return fake_core.main(argv, wrap_core=_wrap, proc_defaults={"step_timeout_s": 60.0, "drain_timeout_s": 10.0})


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
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"{SEGMENT_PREFIX}{pid}")]


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


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "fake":
    sys.exit(fake_main(sys.argv[2:]))
