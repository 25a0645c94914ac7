"""The README's "Using it" section runs as written: every ```bash and ```python block, in
order, from a scratch directory holding the repository's `examples/` and `engine/`, with a
private ipc socket and a free port in place of `/tmp/diffslot.sock` and 8000 (so that runs
beside each other never collide). Blocks fenced ```bash gpu (a GPU and a hub download)
and ```bash ray (a Ray cluster; tests/test_ray_app.py covers the app) are not run.

Then what the README promises of the engine its first block started: the img2img and
inpainting settings of its examples read as their prompt for at least 7 of seeds 0-7; the
adapters shipped with the embedded model change the shapes' size as it says; an adapter
that is not there is a 404 when named as the model."""
from __future__ import annotations

import io
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np
import pytest

from proc_helpers import REPO, env

SECTION = "## Using it"
NOT_RUN = {"bash gpu", "bash ray"}
SOCKET, PORT = "ipc:///tmp/diffslot.sock", "8000"


def blocks(readme: str) -> list[tuple[str, str]]:
    """(info string, code) of each fenced block of the section, in order."""
    start = readme.index(SECTION)
    end = readme.find("\n## ", start + len(SECTION))
    section = readme[start:end if end != -1 else None]
    return [(m.group(1).strip(), m.group(2)) for m in re.finditer(r"^```([^\n]*)\n(.*?)^```", section, re.S | re.M)]


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_the_section_has_the_blocks_it_promises():
    found = blocks((REPO / "README.md").read_text())
    kinds = {info for info, _ in found}
    assert kinds <= {"bash", "python"} | NOT_RUN, kinds
    assert sum(info == "python" for info, _ in found) >= 4 and sum(info == "bash" for info, _ in found) >= 1
    gpu = next(code for info, code in found if info == "bash gpu")
    assert "--model stabilityai/" in gpu and "--variant fp16" in gpu and ".safetensors --config" in gpu


@pytest.mark.timeout(900)
def test_every_snippet_runs_as_written(tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    for name in ("examples", "engine", "frontend"):
        (scratch / name).symlink_to(REPO / name)
    socket_dir = pathlib.Path(tempfile.mkdtemp(prefix="dsr-", dir="/tmp"))
    address, port = f"ipc://{socket_dir / 'engine.sock'}", free_port()
    environment = env()
    groups: list[int] = []  # each bash block's process group: what it left running in the background
    try:
        for number, (info, code) in enumerate(blocks((REPO / "README.md").read_text())):
            if info in NOT_RUN:
                continue
            code = re.sub(r"ipc:///tmp/(diffslot[\w-]*)\.sock", lambda m: f"ipc://{socket_dir / m.group(1)}.sock",
                          code.replace(SOCKET, address)).replace(f"127.0.0.1:{PORT}", f"127.0.0.1:{port}") \
                       .replace(f"--port {PORT}", f"--port {port}")
            command = ["bash", "-euo", "pipefail", "-c", code] if info == "bash" else [sys.executable, "-c", code]
            log = tmp_path / f"block-{number}.log"  # a file: background jobs write to it for as long as they run
            with open(log, "wb") as out:
                process = subprocess.Popen(command, cwd=scratch, env=environment, stdout=out,
                                           stderr=subprocess.STDOUT, start_new_session=True)
            if info == "bash":
                groups.append(process.pid)
            try:
                process.wait(timeout=300)
            except subprocess.TimeoutExpired:
                pytest.fail(f"this block did not finish in 300 s:\n{code}\n--- output ---\n"
                            f"{log.read_text(errors='replace')[-4000:]}")
            if process.returncode != 0:
                pytest.fail(f"this block failed ({process.returncode}):\n{code}\n--- output ---\n"
                            f"{log.read_text(errors='replace')[-4000:]}")
        for image in ("out.png", "blue.png", "green.png", "big.png"):
            assert (scratch / image).stat().st_size > 0, image
        _check_edits(address, scratch)
        _check_adapters(address, port)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
        assert 'route="/v1/images/edits",status="200"' in metrics  # the README's edit, under its own route
    finally:
        for group in groups:
            _stop_group(group)
        import shutil

        shutil.rmtree(socket_dir, ignore_errors=True)


def _stop_group(group: int) -> None:
    """SIGTERM what a block left running (the engine drains, the gateway stops), SIGKILL after 30 s."""
    try:
        os.killpg(group, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.killpg(group, signal.SIGKILL)


def _check_edits(address: str, scratch: pathlib.Path) -> None:
    """The README's edit settings, seeds 0-7, through the engine its first block started."""
    from PIL import Image

    from engine.demo import IMG2IMG, INPAINT
    from engine.models.shapes.classify import classify
    from frontend import Client, Completed, GenerateParams

    def png(path: pathlib.Path) -> bytes:
        return path.read_bytes()

    readme = (REPO / "README.md").read_text()
    assert f"--strength {IMG2IMG['strength']:g} --guidance {IMG2IMG['guidance']:g}" in readme
    assert f"--strength {INPAINT['strength']:g} --guidance {INPAINT['guidance']:g}" in readme
    edits = {"blue circle": dict(image=png(scratch / "examples" / "in.png"), **IMG2IMG),
             "green square": dict(image=png(scratch / "examples" / "square.png"),
                                  mask=png(scratch / "examples" / "mask.png"), **INPAINT)}
    with Client(address) as client:
        handles = {(want, seed): client.submit(GenerateParams(prompt=f"a {want}", seed=seed, output="png", **kw))
                   for want, kw in edits.items() for seed in range(8)}
        results = {key: handle.result(timeout=300) for key, handle in handles.items()}
    for want in edits:
        images = []
        for seed in range(8):
            result = results[(want, seed)]
            assert isinstance(result, Completed), result
            images.append(np.asarray(Image.open(io.BytesIO(result.output)).convert("RGB")))
        reads = classify(np.stack(images))
        assert sum(read == want for read in reads) >= 7, (want, reads)


def _check_adapters(address: str, port: str) -> None:
    """`big` grows the shapes and `small` shrinks them (the fraction of the image the shape
    covers, 8 samples each, beside the same requests without an adapter)."""
    import openai
    from PIL import Image

    from engine.models.shapes.train_lora import shape_area
    from frontend import Client, Completed, GenerateParams

    prompts = ("a red circle", "a green square", "a blue triangle", "a red cross")
    styles = {"none": {}, "big": {"big": 1.0}, "small": {"small": 1.0}}
    with Client(address) as client:
        handles = {(style, prompt, seed): client.submit(GenerateParams(prompt=prompt, steps=20, sampler="dpmpp_2m",
                                                                       seed=seed, output="png", loras=loras))
                   for style, loras in styles.items() for prompt in prompts for seed in (100, 101)}
        results = {key: handle.result(timeout=300) for key, handle in handles.items()}
    area = {}
    for style in styles:
        images = [results[key] for key in results if key[0] == style]
        assert all(isinstance(r, Completed) for r in images), images
        area[style] = float(shape_area(np.stack([np.asarray(Image.open(io.BytesIO(r.output)).convert("RGB"))
                                                 for r in images])).mean())
    assert area["big"] > 1.3 * area["none"] and area["small"] < 0.5 * area["none"], area
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="K", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="model"):
        client.images.generate(prompt="a red circle", model="watercolor")
