"""A soak: valid traffic of every kind against one engine and its gateway for N minutes,
on loopback only, bounded in time and count. It proves the bounds hold together:

    python bench/soak.py [--minutes 3] [--slots 4] [--quick]

It builds a tiny random SD folder (img2img and inpainting) and one LoRA adapter, starts
`python -m engine serve` on it (CPU, an ipc socket, `--max-input-bytes` small so that
images at the limit are cheap) and `python -m frontend http` in front, then measures a
bystander's 4-step 16×16 request, and runs for `--minutes`, all at once:

* text-to-image at every size the model takes (16–64 px), every sampler and output
  kind, straight to the engine (AsyncClient) and through the gateway;
* img2img and inpainting with an image (and mask) of exactly `--max-input-bytes` at the
  largest size, to the engine and as edits forms through the gateway;
* requests with the adapter while its file is rewritten on disk every few seconds;
* cancels: engine requests canceled at a random moment, HTTP requests abandoned;
* slow uploads (an edits form trickled over seconds, then completed) and abandoned ones
  (half a form, then the connection closed);
* idle connections (half a request line, held until the gateway's header timeout);
* the bystander, one request after the other, its latency sampled both while the
  traffic runs and while it is paused (4 s in every 16, the first 1.5 s not sampled),
  so that its idle and loaded medians see the same (shared) machine.

Each traffic worker keeps one request in flight and pauses `--think-s` (mean) between
its requests: valid traffic from several clients, not a flood (the engine's own flood
bounds are tested in tests/test_serve_bounds.py).

Every request has a deadline; one without an answer by then is *wedged*, one that
failed for a transport reason (engine dead, connection lost) is *lost*. The engine's
(process tree) and the gateway's RSS are sampled every second; growth is the median of
the last fifth of the run over the median of the fifth after warm-up (the first third).
Prints one table and a verdict per bound: RSS growth ≤ 5 %, 0 lost or wedged, the
bystander's p50 under load within 2× its idle p50. Exit status 1 if any request was
lost or wedged.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import itertools
import os
import pathlib
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
from PIL import Image, ImageDraw, PngImagePlugin  # noqa: E402

from engine.core.config import CoreConfig  # noqa: E402
from engine.protocol import Canceled, Completed, GenerateParams, Rejected  # noqa: E402
from frontend.async_client import AsyncClient  # noqa: E402
from frontend.client import EngineDeadError  # noqa: E402
from frontend.launcher import EngineProcess, serve_command, stop_process  # noqa: E402

SAMPLERS = ("default", "euler", "euler_ancestral", "ddim", "dpmpp_2m")
PROMPTS = ("a red circle", "a big blue cat", "the small green dog", "a photo of a yellow cross")
DEADLINE_S = 120.0  # an answer later than this is a wedged request
LOADED_S, PAUSED_S, DRAIN_S = 12.0, 4.0, 1.5  # traffic on, traffic paused (its first DRAIN_S not sampled)
MAX_REQUESTS = 20_000  # the soak's own bound, whatever the duration
ADAPTER = dict(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"])


# ----------------------------------------------------------------------------- inputs

def padded_png(image: Image.Image, nbytes: int) -> bytes:
    """`image` as a PNG of exactly `nbytes` bytes (a text chunk pads it): an input at the limit."""
    def encode(pad: int) -> bytes:
        info = PngImagePlugin.PngInfo()
        info.add_text("padding", "x" * pad)
        buffer = io.BytesIO()
        image.save(buffer, format="PNG", pnginfo=info)
        return buffer.getvalue()
    return encode(nbytes - len(encode(0)))


def scene(side: int, seed: int) -> tuple[Image.Image, Image.Image]:
    rng = random.Random(seed)
    image = Image.new("RGB", (side, side), (rng.randrange(256),) * 3)
    ImageDraw.Draw(image).ellipse([2, 2, side - 3, side - 3], fill=(rng.randrange(256), 40, 40))
    mask = Image.new("L", (side, side), 0)
    ImageDraw.Draw(mask).rectangle([0, 0, side // 2, side // 2], fill=255)
    return image, mask


def edit_form(fields: dict, files: dict, boundary: str = "soakboundary") -> tuple[bytes, str]:
    parts = []
    for name, value in fields.items():
        parts.append(f'--{boundary}\r\ncontent-disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode())
    for name, data in files.items():
        parts.append(f'--{boundary}\r\ncontent-disposition: form-data; name="{name}"; filename="{name}.png"\r\n'
                     f'content-type: image/png\r\n\r\n'.encode() + data + b"\r\n")
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


# ----------------------------------------------------------------------------- the stack

def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def tree_rss_mb(pid: int) -> float:
    """RSS of a process and its descendants (the engine's decode workers), MB."""
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        try:
            with open(f"/proc/{current}/status") as status:
                total += next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as children:
                    todo += [int(c) for c in children.read().split()]
        except (OSError, StopIteration, ValueError):
            continue
    return total / 1024


@contextlib.contextmanager
def stack(directory: pathlib.Path, slots: int, max_input: int, group_aging: float):
    from diffusers import StableDiffusionPipeline

    from engine.testing.loras import make_lora
    from engine.testing.tiny_pipelines import build_sd

    folder = build_sd(directory / "tiny-sd", scheduler="ddim", seed=5)
    lora_dir = directory / "loras"
    lora_dir.mkdir()
    pipe = StableDiffusionPipeline.from_pretrained(folder)
    make_lora(pipe, "soak", 1, {"unet": ADAPTER}, lora_dir / "soak")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    address = f"ipc://{directory / 'engine.sock'}"
    command = serve_command(address, "--model", str(folder), "--slots", str(slots), "--device", "cpu",
                            "--decode-workers", "1", "--max-input-bytes", str(max_input), "--lora-dir", str(lora_dir),
                            "--max-queue", "256", "--group-aging", str(group_aging))
    engine = EngineProcess(command, address, directory / "engine.log", env=env, cwd=REPO)
    gateway = None
    try:
        engine.wait_ready(180)
        port = free_port()
        gateway = subprocess.Popen([sys.executable, "-m", "frontend", "http", "--engine", address, "--port", str(port),
                                    "--log-level", "warning", "--header-timeout", "2", "--body-timeout", "5"],
                                   cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                   stderr=open(directory / "gateway.log", "wb"))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            if gateway.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("gateway did not come up:\n" + (directory / "gateway.log").read_text()[-2000:])
            time.sleep(0.2)
        yield address, url, port, engine, gateway, pipe, lora_dir
    finally:
        if gateway is not None:
            stop_process(gateway, 15)
        engine.stop(30)


# ----------------------------------------------------------------------------- the traffic

class Tally:
    def __init__(self) -> None:
        self.rows: dict[str, dict[str, int]] = {}
        self.sent = 0

    def add(self, kind: str, outcome: str) -> None:
        row = self.rows.setdefault(kind, {})
        row[outcome] = row.get(outcome, 0) + 1

    def count(self, outcome: str) -> int:
        return sum(row.get(outcome, 0) for row in self.rows.values())


class Soak:
    def __init__(self, address: str, url: str, port: int, max_input: int, until: float, seed: int = 0,
                 think_s: float = 0.0):
        self.address, self.url, self.port, self.max_input, self.until = address, url, port, max_input, until
        self.think_s = think_s
        self.traffic_on = asyncio.Event()
        self.traffic_on.set()
        self.phase = "loaded"
        self.timings: dict[str, list] = {}  # the bystander's engine timings, per phase
        self.timings: dict[str, list] = {}  # the bystander's engine timings, per phase
        self.rng = random.Random(seed)
        self.tally = Tally()
        self.bystander_s: list[float] = []
        image, mask = scene(64, seed)
        self.image, self.mask = padded_png(image, max_input), padded_png(mask, max_input)

    def running(self) -> bool:
        return time.monotonic() < self.until and self.tally.sent < MAX_REQUESTS

    async def think(self) -> None:
        """A client's pause between its requests (exponential, mean `think_s`): traffic, not a
        flood; and none at all while the traffic is paused for the bystander's idle samples."""
        if self.think_s > 0:
            await asyncio.sleep(min(self.rng.expovariate(1 / self.think_s), 5 * self.think_s))
        await self.traffic_on.wait()

    async def pace(self) -> None:
        """Traffic for LOADED_S, then paused for PAUSED_S, again and again: the bystander's idle
        and loaded samples interleave, so both see the same machine (a shared one varies)."""
        while self.running():
            self.traffic_on.set()
            self.phase = "loaded"
            await asyncio.sleep(LOADED_S)
            self.traffic_on.clear()
            self.phase = "draining"
            await asyncio.sleep(DRAIN_S)  # what was in flight finishes
            self.phase = "idle"
            await asyncio.sleep(PAUSED_S - DRAIN_S)
        self.traffic_on.set()

    async def engine_call(self, client: AsyncClient, kind: str, params: GenerateParams, cancel_after=None) -> None:
        self.tally.sent += 1
        task = asyncio.ensure_future(client.generate(params))
        try:
            if cancel_after is not None:
                await asyncio.sleep(cancel_after)
                task.cancel()
            result = await asyncio.wait_for(asyncio.shield(task), DEADLINE_S)
        except asyncio.CancelledError:
            self.tally.add(kind, "canceled")
            return
        except asyncio.TimeoutError:
            self.tally.add(kind, "wedged")
            task.cancel()
            return
        except (EngineDeadError, ConnectionError, RuntimeError):
            self.tally.add(kind, "lost")
            return
        outcome = {Completed: "completed", Rejected: "rejected", Canceled: "canceled"}.get(type(result), "failed")
        self.tally.add(kind, outcome)

    async def http_call(self, http: httpx.AsyncClient, kind: str, path: str, abandon_after=None, **request) -> None:
        self.tally.sent += 1
        try:
            response = await http.post(path, timeout=abandon_after or DEADLINE_S, **request)
        except httpx.TimeoutException:
            self.tally.add(kind, "canceled" if abandon_after else "wedged")
            return
        except httpx.HTTPError:
            self.tally.add(kind, "lost")
            return
        status = response.status_code
        self.tally.add(kind, "completed" if status == 200 else "rejected" if status in (400, 408, 413, 429, 503)
                       else "failed")

    # each worker keeps one request of its kind in flight, so the load is bounded
    async def text_to_image(self, client: AsyncClient, http: httpx.AsyncClient) -> None:
        for k in itertools.count():
            if not self.running():
                break
            await self.think()
            side_h, side_w = (4 * self.rng.randint(4, 16) for _ in range(2))
            params = dict(prompt=self.rng.choice(PROMPTS), steps=self.rng.randint(2, 5),
                          sampler=self.rng.choice(SAMPLERS), guidance=self.rng.choice([1.0, 3.0]),
                          seed=self.rng.randrange(1 << 30), height=side_h, width=side_w)
            if k % 2 == 0:
                output = self.rng.choice(["png", "uint8", "latent"])
                await self.engine_call(client, "text to image (engine)", GenerateParams(**params, output=output))
            else:
                body = {"prompt": params["prompt"], "size": f"{side_w}x{side_h}", "steps": params["steps"],
                        "sampler": params["sampler"], "seed": params["seed"]}
                await self.http_call(http, "text to image (gateway)", "/v1/images/generations", json=body)

    async def images(self, client: AsyncClient, http: httpx.AsyncClient) -> None:
        for k in itertools.count():
            if not self.running():
                break
            await self.think()
            masked = k // 2 % 2 == 1
            if k % 2 == 0:
                params = GenerateParams(prompt=self.rng.choice(PROMPTS), steps=4, strength=0.6, image=self.image,
                                        mask=self.mask if masked else None, seed=self.rng.randrange(1 << 30),
                                        output="png")
                await self.engine_call(client, "images at the limit (engine)", params)
            else:
                files = {"image": self.image, **({"mask": self.mask} if masked else {})}
                body, content_type = edit_form({"prompt": "a red circle", "steps": "4", "strength": "0.6"}, files)
                await self.http_call(http, "images at the limit (gateway)", "/v1/images/edits", content=body,
                                     headers={"content-type": content_type})

    async def adapters(self, client: AsyncClient, http: httpx.AsyncClient) -> None:
        for k in itertools.count():
            if not self.running():
                break
            await self.think()
            if k % 2 == 0:
                params = GenerateParams(prompt="a red circle", steps=3, loras={"soak": 0.8}, output="png",
                                        seed=self.rng.randrange(1 << 30))
                await self.engine_call(client, "adapter (engine)", params)
            else:
                await self.http_call(http, "adapter (gateway)", "/v1/images/generations",
                                     json={"prompt": "a red circle", "steps": 3, "size": "16x16",
                                           "loras": {"soak": 0.8}})

    async def rewrite_adapter(self, pipe, lora_dir: pathlib.Path) -> None:
        """The adapter's file replaced (atomically) by another of the same shape, every few seconds."""
        from engine.testing.loras import make_lora

        seed = 2
        while self.running():
            await asyncio.sleep(4.0)
            staging = lora_dir.parent / f"staging-{seed}"
            await asyncio.get_running_loop().run_in_executor(
                None, make_lora, pipe, "soak", seed, {"unet": ADAPTER}, staging)
            os.replace(staging / "pytorch_lora_weights.safetensors", lora_dir / "soak" / "pytorch_lora_weights.safetensors")
            shutil.rmtree(staging, ignore_errors=True)
            seed += 1

    async def cancels(self, client: AsyncClient, http: httpx.AsyncClient) -> None:
        for k in itertools.count():
            if not self.running():
                break
            await self.think()
            params = GenerateParams(prompt=self.rng.choice(PROMPTS), steps=20, output="png",
                                    seed=self.rng.randrange(1 << 30))
            if k % 2 == 0:
                await self.engine_call(client, "canceled (engine)", params, cancel_after=self.rng.uniform(0, 0.5))
            else:
                await self.http_call(http, "abandoned (gateway)", "/v1/images/generations",
                                     abandon_after=self.rng.uniform(0.1, 0.5),
                                     json={"prompt": "a red circle", "steps": 20, "size": "32x32"})

    async def uploads(self) -> None:
        """Slow edits uploads (trickled over ~2 s, then completed) and abandoned ones."""
        body, content_type = edit_form({"prompt": "a blue square", "steps": "3"}, {"image": self.image})
        head = (f"POST /v1/images/edits HTTP/1.1\r\nhost: soak\r\ncontent-type: {content_type}\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
        for k in itertools.count():
            if not self.running():
                break
            await self.think()
            abandon = k % 2 == 1
            kind = "upload abandoned (gateway)" if abandon else "upload slow (gateway)"
            self.tally.sent += 1
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
                writer.write(head)
                chunks = 8
                step = len(body) // chunks + 1
                for k in range(chunks):
                    if abandon and k == chunks // 2:
                        break
                    writer.write(body[k * step:(k + 1) * step])
                    await writer.drain()
                    await asyncio.sleep(0.25)
                if abandon:
                    writer.close()
                    self.tally.add(kind, "canceled")
                    continue
                answer = await asyncio.wait_for(reader.read(), DEADLINE_S)
                writer.close()
                status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0
                self.tally.add(kind, "completed" if status == 200 else "rejected" if status in (408, 429, 503)
                               else "failed")
            except asyncio.TimeoutError:
                self.tally.add(kind, "wedged")
            except OSError:
                self.tally.add(kind, "lost")

    async def idle_connections(self, count: int) -> None:
        """`count` connections that send half a request line and wait: the header timeout closes them."""
        while self.running():
            await self.traffic_on.wait()
            opened = []
            for _ in range(count):
                with contextlib.suppress(OSError):
                    reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
                    writer.write(b"GET /heal")
                    opened.append((reader, writer))
            self.tally.sent += len(opened)
            for reader, writer in opened:
                try:
                    closed = await asyncio.wait_for(reader.read(), 10.0) == b""
                    self.tally.add("idle connection", "closed by the server" if closed else "answered")
                except asyncio.TimeoutError:
                    self.tally.add("idle connection", "wedged")
                except OSError:
                    self.tally.add("idle connection", "closed by the server")
                writer.close()

    async def bystander(self, client: AsyncClient, samples: dict[str, list[float]], count: int = 0) -> None:
        """One 4-step request after the other; its latency counted as idle or loaded by the
        phase it began and ended in (none across a change)."""
        params = GenerateParams(prompt="a red circle", steps=4, height=16, width=16, output="png")
        while (count and sum(map(len, samples.values())) < count) or (not count and self.running()):
            phase, start = self.phase, time.monotonic()
            result = await client.generate(params)
            if isinstance(result, Completed) and self.phase == phase and phase in samples:
                samples[phase].append(time.monotonic() - start)
                self.timings.setdefault(phase, []).append(result.timings)
            await asyncio.sleep(0.1)


# ----------------------------------------------------------------------------- the run

class RssSampler:
    def __init__(self, engine_pid: int, gateway_pid: int):
        self.pids = {"engine": engine_pid, "gateway": gateway_pid}
        self.samples: dict[str, list[tuple[float, float]]] = {name: [] for name in self.pids}

    async def run(self, until: float) -> None:
        while time.monotonic() < until:
            for name, pid in self.pids.items():
                self.samples[name].append((time.monotonic(), tree_rss_mb(pid)))
            await asyncio.sleep(1.0)

    def growth(self, name: str, start: float, end: float) -> tuple[float, float, float]:
        """(baseline MB, final MB, growth): medians of the fifth after warm-up (the first third) and the last fifth."""
        span = end - start
        warm = start + span / 3
        base = [mb for t, mb in self.samples[name] if warm <= t < warm + span / 5]
        last = [mb for t, mb in self.samples[name] if t >= end - span / 5]
        if not base or not last:
            return float("nan"), float("nan"), float("nan")
        b, f = statistics.median(base), statistics.median(last)
        return b, f, f / b - 1.0


async def soak(address: str, url: str, port: int, engine_pid: int, gateway_pid: int, minutes: float,
               max_input: int, pipe, lora_dir: pathlib.Path, idle_connections: int,
               think_s: float) -> tuple[Soak, RssSampler, tuple]:
    async with AsyncClient(address, name="soak") as client, AsyncClient(address, name="bystander") as quiet, \
            httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=64)) as http:
        probe = Soak(address, url, port, max_input, time.monotonic())
        await probe.bystander(quiet, {"loaded": []}, count=10)  # warm up: model, caches, the first requests' costs
        start = time.monotonic()
        end = start + 60 * minutes
        run = Soak(address, url, port, max_input, end, think_s=think_s)
        sampler = RssSampler(engine_pid, gateway_pid)
        samples = {"idle": [], "loaded": []}
        workers = [run.pace(), run.text_to_image(client, http), run.text_to_image(client, http), run.images(client, http),
                   run.adapters(client, http), run.rewrite_adapter(pipe, lora_dir), run.cancels(client, http),
                   run.uploads(), run.idle_connections(idle_connections), run.bystander(quiet, samples),
                   sampler.run(end + 1.0)]
        await asyncio.gather(*workers)
        return run, sampler, (samples["idle"], samples["loaded"], start, end)


def report(run: Soak, sampler: RssSampler, idle: list[float], loaded: list[float], start: float, end: float,
           minutes: float) -> bool:
    outcomes = ["completed", "rejected", "canceled", "failed", "lost", "wedged"]
    print(f"soak: {minutes:g} min, {run.tally.sent} requests and connections, each worker pausing "
          f"{run.think_s:g} s on average between its requests")
    print(f"{'traffic':<32}" + "".join(f"{o:>11}" for o in outcomes))
    for kind, row in sorted(run.tally.rows.items()):
        shown = [row.get(o, 0) for o in outcomes]
        extra = {k: v for k, v in row.items() if k not in outcomes}
        print(f"{kind:<32}" + "".join(f"{v:>11}" for v in shown) + (f"   {extra}" if extra else ""))
    lost, wedged = run.tally.count("lost"), run.tally.count("wedged")
    print()
    print(f"{'process':<12}{'RSS after warm-up MB':>22}{'RSS at end MB':>16}{'growth':>9}{'bound':>8}")
    flat = True
    for name in ("engine", "gateway"):
        base, final, growth = sampler.growth(name, start, end)
        ok = growth <= 0.05
        flat &= ok
        print(f"{name:<12}{base:>22.1f}{final:>16.1f}{growth * 100:>8.1f}%{'ok' if ok else 'OVER':>8}")
    p50_idle = statistics.median(idle) if idle else float("nan")
    p50_loaded = statistics.median(loaded) if loaded else float("nan")
    ratio = p50_loaded / p50_idle
    print()
    print(f"bystander 4-step 16x16, traffic paused {PAUSED_S:g} s in every {LOADED_S + PAUSED_S:g}: idle p50 "
          f"{p50_idle * 1000:.0f} ms ({len(idle)}), under load p50 "
          f"{p50_loaded * 1000:.0f} ms ({len(loaded)}): {ratio:.2f}x idle {'ok' if ratio <= 2.0 else 'OVER'} (bound 2x)")
    for phase, timings in sorted(run.timings.items()):
        parts = {name: statistics.median(getattr(t, name) for t in timings) * 1000
                 for name in ("queue_s", "encode_s", "denoise_s", "decode_wait_s", "decode_s", "total_s")}
        print(f"  its engine timings {phase:<7} p50 ms: " + ", ".join(f"{k[:-2]} {v:.0f}" for k, v in parts.items()))
    print(f"lost {lost}, wedged {wedged}: {'ok' if lost == wedged == 0 else 'FAIL'}; RSS "
          f"{'flat' if flat else 'GREW'}")
    return lost == wedged == 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=3.0, help="how long the traffic runs (default 3)")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--max-input-bytes", type=int, default=256 << 10,
                    help="the engine's --max-input-bytes: every image and mask is exactly this large")
    ap.add_argument("--idle-connections", type=int, default=32)
    ap.add_argument("--think-s", type=float, default=0.5,
                    help="each traffic worker's mean pause between its requests (0: back to back, a flood)")
    ap.add_argument("--quick", action="store_true", help="a few seconds of each kind (the smoke test)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads in this process")
    ap.add_argument("--group-aging", type=float, default=CoreConfig.group_aging,
                    help="the engine's --group-aging (0: latent-size groups take turns)")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    minutes = min(args.minutes, 0.1) if args.quick else args.minutes
    minutes = max(0.05, min(minutes, 60.0))  # bounded in time, whatever was asked
    directory = pathlib.Path(tempfile.mkdtemp(prefix="diffslot-soak-"))
    try:
        with stack(directory, args.slots, args.max_input_bytes, args.group_aging) as (address, url, port, engine, gateway, pipe, lora):
            run, sampler, (idle, loaded, start, end) = asyncio.run(soak(
                address, url, port, engine.pid, gateway.pid, minutes, args.max_input_bytes, pipe, lora,
                8 if args.quick else args.idle_connections, args.think_s))
        return 0 if report(run, sampler, idle, loaded, start, end, minutes) else 1
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
