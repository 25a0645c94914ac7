"""The gateway's added latency: a mixed trace through HTTP against the direct client.

    python bench/http_load.py [--quick] [--fake-core] [--requests N] [--rate R]
    python bench/http_load.py --engine ADDR --gateway http://127.0.0.1:8000   # running ones

Replays one mixed trace (the shapes prompts, 2–8 steps, every sampler, guidance 1–5,
Poisson arrivals) twice at once against the same engine: every trace item is sent
both through the gateway (`POST /v1/images/generations`, httpx, keep-alive) and
through the direct `AsyncClient`, at the same instant, with the same parameters, so
both copies share the engine's batches and see the same load.

A request's *overhead* is its latency as its client saw it minus the engine's own
`total_s` (arrival at the engine → usable output, from the response's timings): the
transport both ways, and for HTTP also parsing, base64, JSON and the HTTP client. The
gateway's *added latency* per trace item is its HTTP overhead minus its direct
overhead; the table gives p50/p99 of each. Pairing by overhead rather than by raw
latency keeps the engine's step quantization (a copy admitted one step later) out of
the figure. Prints the table; writes nothing.

By default it starts its own engine (`python -m engine serve --model shapes`, or with
`--fake-core` the model-free test core, which isolates the gateway's cost from CPU
contention with the denoiser) and gateway, and stops both after.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
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

import msgspec
import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.protocol import GenerateParams  # noqa: E402
from frontend.launcher import EngineProcess, serve_command, stop_process  # noqa: E402
from frontend.async_client import AsyncClient  # noqa: E402

from engine.models.shapes.draw import PROMPTS  # noqa: E402
MIXED_SAMPLERS = ("default", "euler", "euler_ancestral", "ddim", "dpmpp_2m")


def trace(n: int, rate: float, seed: int = 0) -> list[tuple[float, GenerateParams]]:
    """(arrival offset s, params) for n requests at Poisson rate `rate`/s."""
    rng = random.Random(seed)
    t, items = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        items.append((t, GenerateParams(prompt=rng.choice(PROMPTS), steps=rng.randint(2, 8),
                                        sampler=rng.choice(MIXED_SAMPLERS), guidance=round(rng.uniform(1.0, 5.0), 1),
                                        seed=rng.randrange(2**31))))
    return items


def body(p: GenerateParams) -> bytes:
    return msgspec.json.encode({"prompt": p.prompt, "steps": p.steps, "sampler": p.sampler, "guidance": p.guidance,
                                "seed": p.seed, "response_format": "b64_json"})


async def via_http(http, p: GenerateParams) -> tuple[float, float]:
    started = time.perf_counter()
    response = await http.post("/v1/images/generations", content=body(p),
                               headers={"content-type": "application/json"})
    latency = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
    return latency, msgspec.json.decode(response.content)["timings"][0]["total_s"]


async def via_client(client: AsyncClient, p: GenerateParams) -> tuple[float, float]:
    started = time.perf_counter()
    result = await client.generate(p)
    latency = time.perf_counter() - started
    if type(result).__name__ != "Completed":
        raise RuntimeError(f"direct request ended {result}")
    return latency, result.timings.total_s


async def replay(engine: str, gateway: str, items, warmup: int) -> list[tuple]:
    import httpx

    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with AsyncClient(engine) as client, \
            httpx.AsyncClient(base_url=gateway, limits=limits, timeout=300) as http:
        known = [q for q in client.client.welcome.prompts if q]  # a class-conditional model's own names
        if known:
            items = [(offset, msgspec.structs.replace(p, prompt=known[PROMPTS.index(p.prompt) % len(known)]))
                     for offset, p in items]
        for _, p in items[:warmup]:  # connections, caches, the gateway's first-request costs
            await asyncio.gather(via_http(http, p), via_client(client, p))
        start = time.perf_counter()

        async def one(offset, p):
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            return await asyncio.gather(via_http(http, p), via_client(client, p))

        return await asyncio.gather(*(one(offset, p) for offset, p in items[warmup:]))


def pct(values, q) -> float:
    return float(np.percentile(np.asarray(values) * 1e3, q))


def report(pairs, wall_s: float, label: str) -> None:
    http_lat = [h[0] for h, _ in pairs]
    direct_lat = [d[0] for _, d in pairs]
    http_over = [h[0] - h[1] for h, _ in pairs]
    direct_over = [d[0] - d[1] for _, d in pairs]
    added = [ho - do for ho, do in zip(http_over, direct_over)]
    print(f"\n{label}: {len(pairs)} trace items × 2 paths in {wall_s:.1f}s")
    print(f"{'path':<22}{'latency p50':>13}{'p99':>9}{'overhead p50':>15}{'p99':>9}   (ms)")
    for name, lat, over in (("direct AsyncClient", direct_lat, direct_over), ("HTTP gateway", http_lat, http_over)):
        print(f"{name:<22}{pct(lat, 50):>13.2f}{pct(lat, 99):>9.2f}{pct(over, 50):>15.2f}{pct(over, 99):>9.2f}")
    print(f"{'gateway added':<22}{'':>13}{'':>9}{pct(added, 50):>15.2f}{pct(added, 99):>9.2f}"
          f"   (mean {statistics.fmean(added) * 1e3:.2f})")
    print("overhead = latency seen by the client − the engine's total_s (arrival → usable output); "
          "gateway added = HTTP overhead − direct overhead of the same trace item")


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU time of a process (Linux /proc), None if unknown."""
    if pid is None:
        return None
    try:
        text = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def own_stack(fake_core: bool, slots: int):
    """An engine and a gateway of our own, stopped after."""
    import httpx

    directory = pathlib.Path(tempfile.mkdtemp(prefix="dsb-", dir="/tmp"))
    address = f"ipc://{directory / 'engine.sock'}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, str(REPO / "tests" / "fake_core.py"), "--address", address, "--slots", str(slots),
               "--step-delay", "0.002"] if fake_core else \
        serve_command(address, "--model", "shapes", "--slots", str(slots), "--decode-workers", "1", "--device", "cpu")
    engine = EngineProcess(command, address, directory / "engine.log", env=env, cwd=REPO)
    gateway = None
    try:
        engine.wait_ready(300)
        port = free_port()
        gateway = subprocess.Popen([sys.executable, "-m", "frontend", "http", "--engine", address, "--port", str(port),
                                    "--log-level", "warning"], cwd=REPO, env=env,
                                   stdout=subprocess.DEVNULL, stderr=open(directory / "gateway.log", "wb"))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            if gateway.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("gateway did not come up:\n" + (directory / "gateway.log").read_text()[-2000:])
            time.sleep(0.1)
        yield address, url, gateway.pid
    finally:
        if gateway is not None:
            stop_process(gateway, 15)
        engine.stop()
        shutil.rmtree(directory, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a ~20 s smoke: fewer requests")
    ap.add_argument("--requests", type=int, default=None, help="trace items (each sent on both paths)")
    ap.add_argument("--rate", type=float, default=None, help="trace items per second (Poisson)")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--fake-core", action="store_true", help="the model-free test core instead of shapes")
    ap.add_argument("--engine", default=None, help="use this running engine (with --gateway)")
    ap.add_argument("--gateway", default=None, help="use this running gateway, e.g. http://127.0.0.1:8000")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    n = args.requests or (40 if args.quick else 200)
    rate = args.rate or (4.0 if args.quick else 4.0)
    warmup = 4
    items = trace(n + warmup, rate, args.seed)
    label = f"{'fake core' if args.fake_core else 'shapes'} engine, rate {rate:g}/s, steps 2–8, {len(MIXED_SAMPLERS)} samplers"
    if args.engine and args.gateway:
        stack = contextlib.nullcontext((args.engine, args.gateway, None))
        label = f"engine {args.engine}, gateway {args.gateway}, rate {rate:g}/s"
    elif args.engine or args.gateway:
        ap.error("--engine and --gateway go together")
    else:
        stack = own_stack(args.fake_core, args.slots)
    with stack as (engine, gateway, gateway_pid):
        started = time.perf_counter()
        cpu_before = cpu_seconds(gateway_pid)
        pairs = asyncio.run(replay(engine, gateway, items, warmup))
        cpu_after = cpu_seconds(gateway_pid)
        report(pairs, time.perf_counter() - started, label)
        if cpu_before is not None and cpu_after is not None:
            print(f"gateway process CPU: {(cpu_after - cpu_before) / len(items) * 1e3:.2f} ms per request "
                  f"(user+system, warm-up included; independent of how busy the machine is)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
