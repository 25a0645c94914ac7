"""The HTTP tests' one way to start a gateway: `python -m frontend http` as a subprocess
on 127.0.0.1 and a free port, in front of an engine's address (`gateway`), or together
with its engine (`serving`: a real engine on a model folder, or the fake core); every
process is stopped and reaped by the context manager that started it.

    with serving("--model", str(folder), "--slots", "4") as (engine, gw):
        client = gw.openai()
    with fake_engine(...) as engine, gateway(engine.address, "--api-key", "k") as gw:
        ...
"""
from __future__ import annotations

import base64
import contextlib
import io
import pathlib
import socket
import subprocess
import sys
import time

import httpx

from tests.proc_helpers import REPO, env, fake_engine, real_engine, socket_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Gateway:
    def __init__(self, popen: subprocess.Popen, port: int, log_path: pathlib.Path):
        self.popen, self.port, self.log_path = popen, port, log_path
        self.url = f"http://127.0.0.1:{port}"

    def openai(self, key: str = "unused", **kwargs):
        """An `openai.OpenAI` client of this gateway: no retries, 60 s timeout."""
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60, **kwargs)

    def log(self, tail: int | None = None) -> str:
        """The gateway's output so far (its last `tail` characters)."""
        text = self.log_path.read_text(errors="replace")
        return text if tail is None else text[-tail:]


@contextlib.contextmanager
def gateway(engine_address: str, *args: str, ready: bool = True, extra_env: dict | None = None,
            log_level: str = "warning", timeout: float = 60.0):
    """`python -m frontend http --engine ADDRESS *args` on a free port; when `ready`, wait
    until /health is 200 (else until it answers at all). Stopped (SIGTERM, then SIGKILL)
    and reaped after."""
    with socket_dir() as directory:
        port, log_path = free_port(), directory / "gateway.log"
        with open(log_path, "wb") as log:
            popen = subprocess.Popen([sys.executable, "-m", "frontend", "http", "--engine", engine_address,
                                      "--port", str(port), "--log-level", log_level, *args],
                                     cwd=REPO, env={**env(), **(extra_env or {})}, stdout=log,
                                     stderr=subprocess.STDOUT)
        gw = Gateway(popen, port, log_path)
        try:
            deadline = time.monotonic() + timeout
            while True:
                if popen.poll() is not None:
                    raise RuntimeError(f"gateway exited with {popen.returncode}:\n{gw.log(4000)}")
                with contextlib.suppress(httpx.HTTPError):
                    status = httpx.get(gw.url + "/health", timeout=2).status_code
                    if status == 200 or not ready:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"gateway not ready within {timeout}s:\n{gw.log(4000)}")
                time.sleep(0.1)
            yield gw
        finally:
            if popen.poll() is None:
                popen.terminate()
                try:
                    popen.wait(15)
                except subprocess.TimeoutExpired:
                    popen.kill()
                    popen.wait()


@contextlib.contextmanager
def serving(*engine_args: str, fake: bool = False, engine_env: dict | None = None, gateway_args: tuple = (),
            **gateway_options):
    """An engine and a gateway in front of it: yields (engine, gateway). `fake`: the fake
    core (tests/fake_core.py) behind the engine process, else `python -m engine serve` on
    CPU (`engine_env`: extra environment for the real engine). `gateway_args` and
    `gateway_options` go to `gateway`."""
    if fake:
        assert engine_env is None, "the fake engine takes no extra environment"
        started = fake_engine(*engine_args)
    else:
        started = real_engine(*engine_args, extra_env=engine_env)
    with started as engine, gateway(engine.address, *gateway_args, **gateway_options) as gw:
        yield engine, gw


def png_size(b64: str) -> tuple[int, int]:
    """(width, height) of a base64 PNG (an API's `b64_json`)."""
    from PIL import Image

    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert image.format == "PNG"
    return image.size
