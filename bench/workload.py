"""Mixed-workload benchmark: a real engine process driven by several client processes.

    python bench/workload.py [--model shapes|tiny|PATH] [--slots 16] [--rate R] [--duration S]
                             [--clients 3] [--seed 0] [--quick] [--configs a,b,...]
                             [--json OUT.json] [--plot OUT.png] [--no-overhead]

One invocation runs every configuration below, one after another, each on a fresh
server process and on the SAME seeded arrival schedule:

  static+padded         `python -m engine serve --admission static --layout padded`: a new
                        batch only when the last one has finished, every slot computed —
                        what a plain diffusers pipeline call with a batch does;
  continuous+padded     free slots refilled at every step boundary, still a fixed batch;
  continuous+compact    only active rows gathered (the default engine);
  continuous+bucketed   compact rounded up to a bucket size;
  diffusers-batched     the outside baseline: the same model served the way diffusers users
                        do it today, by a minimal server (`--serve-baseline`, in this file) that
                        speaks the diffslot wire protocol, so the same client processes drive
                        it. Policy (chosen, and it is the kind one to the baseline): whenever
                        it is idle it takes the oldest queued request and every other queued
                        request with the same (sampler, steps), up to --slots of them, and
                        runs them as ONE pipeline-style loop — one diffusers scheduler, one
                        shared timestep, both guidance branches for the whole batch when any
                        request uses guidance (per-row guidance scale; a guidance-1 request's
                        unconditional row is wasted, counted as padded), per-request
                        generators (so each result equals DESIGN.md section 3) — to
                        completion, then decodes the batch with the VAE and PNG-encodes it in
                        the same process. Requests that arrive meanwhile wait for the next
                        batch. A cancel of a queued request removes it; a cancel of a running
                        one is answered at once but its row keeps being computed until the
                        batch ends (a pipeline call cannot drop one row); those rows count as
                        padded, their work as canceled.

The workload (seeded, `--seed`): Poisson arrivals at `--rate` requests/s (default 5: on 2
busy CPU cores that is about twice static+padded's capacity and under continuous+compact's) for
`--duration` seconds (default 30); step counts 5 / 20 / 50 (shares 0.4 / 0.35 / 0.25), samplers euler,
euler_ancestral, ddim, dpmpp_2m and guidance 1.0 / 3.0 / 7.5 drawn uniformly, conditions
and seeds at random, output PNG. A share (`--cancel-share`, 0.3) of the 50-step requests
is canceled by its client when its Progress reaches a step drawn uniformly from 1..49
(the same step in every configuration). Requests are spread over `--clients` client
processes (multiprocessing spawn, one `frontend.Client` each) plus ONE slow client that
reads its results late (its IO thread dawdles `--slow-read` s on every result before
taking it, so results pile up in the engine's per-client backlog; R8 says that must not
stall anyone else).

Every server is started at the beginning (`--no-prestart`: each just before its turn), so
their start-ups overlap; a server waiting for its turn is idle (its busy loop and decode
workers block), and the configurations run one at a time. Torch threads of each server:
`--threads` (default CPUs − 1); decode workers: `--decode-workers` (default 1).
Per configuration, the server is waited for (handshake), warmed
up (one short request per sampler; schedules of every (sampler, steps) built), sampled
with Stats every 0.2 s while the clients run (queue depth = backlog, busy slots =
occupancy), and at the end its peak resident memory (VmHWM of /proc/<pid>/status, and of
its decode workers) is read; then it is stopped (SIGTERM, reaped) and /dev/shm is checked
for `diffslot-<pid>-*` segments it left (any is an error: exit 1).

Reported per configuration:
  goodput        completed (usable) images / (last result − first arrival), images/s
  TTUO           time to usable output (Completed.timings.total_s: arrival at the server →
                 PNG ready), p50 / p99 per step class
  queue, denoise, decode   Completed.timings queue_s, denoise_s, decode_wait_s + decode_s
  evals          useful / total denoiser rows, padded rows, canceled work (rows spent on
                 requests later canceled): Stats deltas over the run
  service rate   (completed + canceled) / busy time (busy: a Stats sample saw a busy slot or
                 a queued request), the μ of the fluid queue model
  peak memory    VmHWM of the server process (and, separately, its decode workers)
and an in-process table of engine overhead per step at 32 slots (EngineCore on the same
model: everything in `core.step()` but the denoiser call and the update kernel, over the
denoiser call).

Outputs: tables on stdout; `--json` (default bench/results/workload.json) with, under
"configs", each configuration's `arrival_rate`, `service_rate` and `backlog` series (queue
depth during the arrival window, where the fluid model's constant arrival rate applies; the
whole series, drain included, is `backlog_all`) in the schema
`python -m engine queue-instrument --from-run` reads, plus richer fields (per-class
latencies, evaluation counts, occupancy series, every request's record, phase times);
`--plot` (default bench/results/workload.png): time-to-usable-output CDF per configuration,
slot occupancy and backlog over time.

`--quick` (CI smoke, under 2 minutes on 2 CPU cores): 5 s of arrivals at 3 requests/s,
fewer overhead repeats. The full run takes a few minutes.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import os
import pathlib
import platform
import queue as queue_module
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `engine`, `frontend` and `tests.reference` import from the repo root
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

# Client processes import this module (spawn): keep torch and diffusers out of the top level.

CONFIGS = {  # name → (admission, layout); None: the diffusers-style baseline server
    "static+padded": ("static", "padded"),
    "continuous+padded": ("continuous", "padded"),
    "continuous+compact": ("continuous", "compact"),
    "continuous+bucketed": ("continuous", "bucketed"),
    "diffusers-batched": None,
}
STEP_CLASSES = (5, 20, 50)
STEP_SHARES = (0.4, 0.35, 0.25)
SAMPLERS = ("euler", "euler_ancestral", "ddim", "dpmpp_2m")
GUIDANCES = (1.0, 3.0, 7.5)
STATS_INTERVAL_S = 0.2
OVERHEAD_SLOTS = 32


# ==================================================================== the schedule

def make_schedule(seed: int, rate: float, duration: float, clients: int, conditions: list[str],
                  cancel_share: float) -> list[dict]:
    """The seeded arrival schedule every configuration replays. `clients` counts the slow
    client too (it is the last index)."""
    rng = np.random.default_rng(seed)
    t, requests = 0.0, []
    while True:
        t += rng.exponential(1.0 / rate)
        if t > duration:
            break
        steps = int(rng.choice(STEP_CLASSES, p=STEP_SHARES))
        cancel_at = None
        if steps == max(STEP_CLASSES) and rng.random() < cancel_share:
            cancel_at = int(rng.integers(1, steps))
        requests.append(dict(
            i=len(requests), t=round(float(t), 4), client=int(rng.integers(clients)),
            condition=str(conditions[rng.integers(len(conditions))]), steps=steps,
            sampler=str(SAMPLERS[rng.integers(len(SAMPLERS))]), guidance=float(GUIDANCES[rng.integers(len(GUIDANCES))]),
            seed=int(rng.integers(2**31)), cancel_at=cancel_at))
    return requests


# ==================================================================== client processes

def _slow_client_class():
    from engine.protocol import Heartbeat
    from frontend import Client

    class SlowClient(Client):
        """Reads its results late: before taking each result (a frame with an output
        attached) its IO thread waits `read_delay` s, so later messages pile up in the
        engine's backlog for this client. Heartbeats continue, so it is slow, not dead."""

        read_delay = 0.5

        def _handle(self, decoder, frames):
            if len(frames) > 1:
                deadline = time.monotonic() + self.read_delay
                while (left := deadline - time.monotonic()) > 0:
                    time.sleep(min(0.2, left))
                    self._send(Heartbeat())
            super()._handle(decoder, frames)

    return SlowClient


def _cancel_when(handle, step: int) -> None:
    try:
        for p in handle.progress():
            if p.step >= step:
                handle.cancel()
                return
    except Exception:
        pass  # the request ended some other way; its result says how


def run_client_job(index: int, slow_read_s: float, address: str, t0: float, requests: list[dict],
                   deadline: float) -> list[dict]:
    """One client's share of the schedule: submit each request at t0 + its arrival time,
    cancel the marked ones at their step, collect every result."""
    import msgspec

    from frontend import Client, Completed, EngineDeadError, GenerateParams

    cls = _slow_client_class() if slow_read_s > 0 else Client
    records = []
    with cls(address, name=f"workload-{index}", connect_timeout=30) as client:
        if slow_read_s > 0:
            client.read_delay = slow_read_s
        pending = []
        for spec in requests:
            wait = t0 + spec["t"] - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            params = GenerateParams(condition=spec["condition"], steps=spec["steps"], sampler=spec["sampler"],
                                    guidance=spec["guidance"], seed=spec["seed"], output="png")
            record = dict(i=spec["i"], client=index, submitted=time.monotonic() - t0)
            try:
                handle = client.submit(params, request_id=f"w{spec['i']}", progress=spec["cancel_at"] is not None)
            except Exception as exc:  # the connection is dead: every later submit says so too
                record["kind"], record["reason"] = "dead", f"submit failed: {exc}"
                records.append(record)
                continue
            handle.add_done_callback(lambda h, r=record: r.__setitem__("received", time.monotonic() - t0))
            if spec["cancel_at"] is not None:
                threading.Thread(target=_cancel_when, args=(handle, spec["cancel_at"]), daemon=True).start()
            pending.append((handle, record))
        for handle, record in pending:
            try:
                result = handle.result(timeout=max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                record["kind"] = "timeout"
                handle.cancel()
            except EngineDeadError as exc:
                record["kind"], record["reason"] = "dead", str(exc)
            else:
                record["kind"] = type(result).__name__.lower()
                if hasattr(result, "timings"):
                    record["timings"] = msgspec.structs.asdict(result.timings)
                if isinstance(result, Completed):
                    ok = isinstance(result.output, bytes) and result.output[:8] == b"\x89PNG\r\n\x1a\n"
                    record["usable"] = bool(ok)
                for field in ("reason", "error"):
                    if hasattr(result, field):
                        record["reason"] = getattr(result, field)
            records.append(record)
    return records


def client_main(index: int, slow_read_s: float, commands, results) -> None:
    """A client process: runs jobs until it gets None."""
    import logging

    logging.basicConfig(level=logging.ERROR)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    while True:
        job = commands.get()
        if job is None:
            return
        try:
            results.put((index, run_client_job(index, slow_read_s, **job), None))
        except Exception:
            results.put((index, [], traceback.format_exc()))


class ClientPool:
    """`n` client processes (the last one slow), kept across configurations."""

    def __init__(self, n: int, slow_read_s: float):
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(n)]
        self.procs = [ctx.Process(target=client_main, name=f"workload-client-{i}", daemon=True,
                                  args=(i, slow_read_s if i == n - 1 else 0.0, self.commands[i], self.results))
                      for i in range(n)]
        for p in self.procs:
            p.start()

    def run(self, address: str, t0: float, schedule: list[dict], deadline: float) -> tuple[list[dict], list[str]]:
        for i, commands in enumerate(self.commands):
            commands.put(dict(address=address, t0=t0, deadline=deadline,
                              requests=[r for r in schedule if r["client"] == i]))
        records, errors = [], []
        for _ in self.commands:
            try:
                index, got, error = self.results.get(timeout=max(5.0, deadline - time.monotonic() + 30))
            except queue_module.Empty:
                errors.append("a client process did not report back")
                break
            records += got
            if error:
                errors.append(f"client {index}: {error}")
        return records, errors

    def close(self) -> None:
        for commands in self.commands:
            with contextlib.suppress(Exception):
                commands.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


# ==================================================================== the baseline server

def serve_baseline(address: str, model_path: str, slots: int) -> int:
    """A minimal ROUTER server speaking the diffslot protocol around a diffusers-style
    batched loop (policy in the module docstring). Single-threaded: between denoising
    steps it takes in messages, answers Stats and sends heartbeats."""
    import collections

    import torch
    import zmq

    from engine.decode_stage import encode_png
    from engine.model import load_model
    from engine.protocol import (
        PROTOCOL_VERSION, Accepted, Cancel, Canceled, Completed, EngineDead, Goodbye, Hello, Heartbeat, Progress,
        Rejected, Stats, StatsReply, Submit, Timings, Welcome, client_decoder, encoder,
    )
    from engine.solvers import init_noise_sigma, make_scheduler

    model = load_model(model_path, "cpu")
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(address)
    enc, dec = encoder(), client_decoder()
    heartbeat_s, peer_timeout_s = 0.5, 10.0
    welcome = Welcome(PROTOCOL_VERSION, os.getpid(), heartbeat_s, peer_timeout_s, 64 << 20, str(model_path),
                      list(model.conditions), int(model.native_size))
    stop = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.append(True))

    class Req:
        __slots__ = ("identity", "rid", "params", "arrival", "progress", "canceled", "timings", "started")

        def __init__(self, identity, rid, params, arrival, progress):
            self.identity, self.rid, self.params, self.arrival, self.progress = identity, rid, params, arrival, progress
            self.canceled, self.started, self.timings = False, 0.0, Timings()

    peers: dict[bytes, float] = {}
    backlog: dict[bytes, collections.deque] = collections.defaultdict(collections.deque)
    waiting: collections.deque[Req] = collections.deque()
    live: dict[tuple[bytes, str], Req] = {}
    running: list[Req] = []
    counters = collections.Counter()
    last_beat = [0.0]

    def send(identity: bytes, msg, payload: bytes | None = None) -> None:
        frames = [identity, enc.encode(msg)] + ([payload] if payload is not None else [])
        if backlog.get(identity):
            backlog[identity].append(frames)
            return
        try:
            router.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            backlog[identity].append(frames)
        except zmq.ZMQError:
            peers.pop(identity, None)  # gone

    def flush() -> None:
        for identity, frames_queue in list(backlog.items()):
            while frames_queue:
                try:
                    router.send_multipart(frames_queue[0], flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError:
                    frames_queue.clear()
                    break
                frames_queue.popleft()

    def cancel(req: Req) -> None:
        if req.canceled:
            return
        req.canceled = True
        live.pop((req.identity, req.rid), None)
        counters["canceled_requests"] += 1
        counters["canceled_evals"] += req.timings.evals
        now = time.monotonic()
        if req.started:
            req.timings.denoise_s = now - req.started
        else:
            req.timings.queue_s = now - req.arrival
            waiting.remove(req)
        req.timings.total_s = now - req.arrival
        send(req.identity, Canceled(req.rid, req.timings))

    def stats() -> dict:
        rows = counters["useful_evals"] + counters["padded_evals"]
        return {"slots": slots, "slots_busy": len(running), "slot_occupancy": len(running) / slots,
                "queue_depth": len(waiting), "batches": counters["batches"],
                "useful_evals": counters["useful_evals"], "padded_evals": counters["padded_evals"],
                "useful_ratio": counters["useful_evals"] / rows if rows else 1.0,
                "canceled_requests": counters["canceled_requests"], "canceled_evals": counters["canceled_evals"],
                "completed": counters["completed"], "pid": os.getpid()}

    def handle(identity: bytes, body: bytes) -> None:
        peers[identity] = time.monotonic()
        try:
            msg = dec.decode(body)
        except Exception as exc:
            send(identity, Rejected("", f"undecodable message: {exc}"))
            return
        if isinstance(msg, Hello):
            send(identity, welcome)
        elif isinstance(msg, Submit):
            p = msg.params
            if p.condition not in model.conditions or p.sampler not in SAMPLERS or not 1 <= p.steps <= 500 \
                    or p.output not in ("png", "latent") or p.height not in (None, model.native_size) \
                    or p.width not in (None, model.native_size):
                send(identity, Rejected(msg.request_id, "the baseline serves png or latent at the native size, "
                                        f"samplers {', '.join(SAMPLERS)}, 1..500 steps", None))
                return
            req = Req(identity, msg.request_id, p, time.monotonic(), msg.progress)
            live[identity, msg.request_id] = req
            waiting.append(req)
            send(identity, Accepted(msg.request_id, len(waiting)))
        elif isinstance(msg, Cancel):
            req = live.get((identity, msg.request_id))
            if req is not None:
                cancel(req)
        elif isinstance(msg, Stats):
            send(identity, StatsReply(msg.token, stats()))
        elif isinstance(msg, Goodbye):
            for req in [r for (ident, _), r in live.items() if ident == identity]:
                cancel(req)
            peers.pop(identity, None)
        # Heartbeat, Delivered: liveness only

    def pump(timeout_s: float) -> None:
        if router.poll(timeout_s * 1000):
            while True:
                try:
                    frames = router.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) == 2:
                    handle(frames[0], frames[1])
        flush()
        now = time.monotonic()
        if now - last_beat[0] >= heartbeat_s:
            last_beat[0] = now
            for identity in list(peers):
                send(identity, Heartbeat())

    @torch.no_grad()
    def run_batch(batch: list[Req]) -> None:
        sampler, steps = batch[0].params.sampler, batch[0].params.steps
        start = time.monotonic()
        for req in batch:
            req.started = start
            req.timings.queue_s = start - req.arrival
        running[:] = batch
        counters["batches"] += 1
        sched = make_scheduler(sampler, model.scheduler_config)
        sched.set_timesteps(steps)
        gens = [torch.Generator("cpu").manual_seed(r.params.seed) for r in batch]
        shape = model.latent_shape(model.native_size, model.native_size)
        x = torch.cat([torch.randn((1, *shape), generator=g, dtype=torch.float32) for g in gens])
        x = x * init_noise_sigma(sched)
        guidance = torch.tensor([r.params.guidance for r in batch], dtype=torch.float32).view(-1, 1, 1, 1)
        cfg = bool((guidance != 1.0).any())
        cond = torch.tensor([model.condition_index(r.params.condition) for r in batch])
        labels = torch.cat([cond, torch.full_like(cond, model.null_index)]) if cfg else cond
        for i, t in enumerate(sched.timesteps):
            xin = torch.cat([x, x]) if cfg else x
            if hasattr(sched, "scale_model_input"):
                xin = sched.scale_model_input(xin, t)
            out = model.denoise(xin, t, labels)
            if cfg:
                out_cond, out_uncond = out.chunk(2)
                out = out_uncond + guidance * (out_cond - out_uncond)
            x = sched.step(out, t, x, generator=gens).prev_sample
            rows_each = 2 if cfg else 1
            for req in batch:
                useful = 0 if req.canceled else (1 if req.params.guidance == 1.0 else 2)
                counters["useful_evals"] += useful
                counters["padded_evals"] += rows_each - useful
                req.timings.evals += useful
                req.timings.padded_evals += rows_each * len(batch) - sum(
                    0 if r.canceled else (1 if r.params.guidance == 1.0 else 2) for r in batch)
                if req.progress and not req.canceled:
                    send(req.identity, Progress(req.rid, i + 1, steps))
            pump(0)
            if stop:
                return
        denoised = time.monotonic()
        keep = [k for k, r in enumerate(batch) if not r.canceled]
        to_png = [k for k in keep if batch[k].params.output == "png"]
        payloads = {}
        if to_png:  # decode the batch, as a pipeline's output step does
            for k, image in zip(to_png, model.decode(x[to_png])):
                png = encode_png(np.ascontiguousarray(image))
                payloads[k] = (png, "png", (len(png),), "uint8")
        for k in keep:
            if k not in payloads:  # "latent": the final latents, for checks against the reference
                array = np.ascontiguousarray(x[k].numpy(), dtype=np.float32)
                payloads[k] = (array.tobytes(), "latent", array.shape, "float32")
        done = time.monotonic()
        for k in keep:
            req = batch[k]
            payload, kind, shape, dtype = payloads[k]
            live.pop((req.identity, req.rid), None)
            req.timings.denoise_s = denoised - start
            req.timings.decode_s = done - denoised
            req.timings.total_s = done - req.arrival
            counters["completed"] += 1
            send(req.identity, Completed(req.rid, req.timings, kind, tuple(shape), dtype), payload)
        running.clear()

    print(f"diffusers-batched baseline ready on {address} (pid {os.getpid()})", flush=True)
    try:
        while not stop:
            if waiting:
                head = waiting[0]
                key = (head.params.sampler, head.params.steps)
                batch = [r for r in waiting if (r.params.sampler, r.params.steps) == key][:slots]
                for r in batch:
                    waiting.remove(r)
                run_batch(batch)
            else:
                pump(0.05)
    finally:
        for identity in list(peers):
            with contextlib.suppress(Exception):
                router.send_multipart([identity, enc.encode(EngineDead("baseline shutting down"))], flags=zmq.NOBLOCK)
        router.close(linger=0)
        ctx.term()
    return 0


# ==================================================================== one configuration

def proc_status_kb(pid: int, field: str) -> int | None:
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def children_of(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return kids


def _cmdline(pid: int) -> bytes:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def shm_leftovers(pid: int) -> list[str]:
    if not os.path.isdir("/dev/shm"):
        return []
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith(f"diffslot-{pid}-"))


def server_command(name: str, args, address: str) -> list[str]:
    spec = CONFIGS[name]
    if spec is None:
        return [sys.executable, str(pathlib.Path(__file__).resolve()), "--serve-baseline", "--address", address,
                "--model", args.model_path, "--slots", str(args.slots)]
    admission, layout = spec
    return [sys.executable, "-m", "engine", "serve", "--model", args.model_path, "--address", address,
            "--slots", str(args.slots), "--layout", layout, "--admission", admission,
            "--decode-workers", str(args.decode_workers), "--device", "cpu", "--max-queue", str(args.max_queue),
            "--log-level", "WARNING"]


def server_env(threads: int) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    return env


class Server:
    """One configuration's server subprocess (its own session, log file and ipc socket)."""

    def __init__(self, name: str, args, tmp: pathlib.Path):
        self.name = name
        slug = name.replace("+", "-")
        self.address = f"ipc://{tmp}/{slug}.sock"
        self.log_path = tmp / f"{slug}.log"
        self.command = server_command(name, args, self.address)
        self.env = server_env(args.threads)
        self.process: subprocess.Popen | None = None
        self.client = None
        self.started_at = 0.0
        self.ready_s = None

    def start(self) -> None:
        print(f"[{self.name}] starting: {' '.join(self.command[1:])}", flush=True)
        self.started_at = time.monotonic()
        with open(self.log_path, "wb") as log_file:
            self.process = subprocess.Popen(self.command, cwd=REPO, env=self.env, stdout=subprocess.DEVNULL,
                                            stderr=log_file, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_ready(self, timeout: float = 300.0):
        """Handshake with a Client (the driver's: warm-up and Stats); returns it."""
        from frontend import Client

        deadline = time.monotonic() + timeout
        while self.client is None:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name}: server exited with {self.process.returncode} before it was "
                                   f"ready:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: server not ready within {timeout:g}s")
            candidate = Client(self.address, connect_timeout=1.0, name="workload-driver")
            try:
                candidate.connect()
                self.client = candidate
            except ConnectionError:
                pass
        if self.ready_s is None:
            self.ready_s = time.monotonic() - self.started_at
        return self.client

    def stop(self) -> int | None:
        """SIGTERM, reap (SIGKILL after 30 s); returns the exit code."""
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close()
            self.client = None
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def log_tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""


def warm_up(client, conditions: list[str]) -> None:
    """One 5-step request per sampler (model, decode path, allocator warm), and the
    schedules of every (sampler, steps) of the workload built (submitted, then canceled)."""
    from frontend import GenerateParams

    handles = []
    for k, sampler in enumerate(SAMPLERS):
        handles.append(client.submit(GenerateParams(condition=conditions[0], steps=5, sampler=sampler,
                                                    guidance=GUIDANCES[k % 3], seed=k, output="png"),
                                     progress=False))
        for steps in STEP_CLASSES[1:]:
            h = client.submit(GenerateParams(condition=conditions[0], steps=steps, sampler=sampler, seed=k,
                                             output="png"), progress=False)
            h.accepted(60)
            h.cancel()
            handles.append(h)
    for h in handles:
        h.result(timeout=300)


class StatsSampler(threading.Thread):
    def __init__(self, client, t0: float):
        super().__init__(name="workload-stats", daemon=True)
        self.client, self.t0 = client, t0
        self.samples: list[dict] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        next_at = self.t0
        self.stopping.wait(max(0.0, next_at - time.monotonic()))
        while not self.stopping.is_set():
            try:
                s = self.client.stats(timeout=5.0)
            except TimeoutError:
                s = None
            except Exception:  # the server is gone
                return
            if s is not None:
                self.samples.append(dict(t=time.monotonic() - self.t0, queue=int(s.get("queue_depth", 0)),
                                         busy=int(s.get("slots_busy", 0)), slots=int(s.get("slots", 1)),
                                         useful=int(s.get("useful_evals", 0)), padded=int(s.get("padded_evals", 0))))
            next_at += STATS_INTERVAL_S
            self.stopping.wait(max(0.0, next_at - time.monotonic()))


def run_config(server: Server, args, schedule: list[dict], pool: ClientPool, conditions: list[str]) -> dict:
    name = server.name
    errors: list[str] = []
    phases = {}
    try:
        client = server.wait_ready()
        phases["start_s"] = server.ready_s
        began = time.monotonic()
        warm_up(client, conditions)
        phases["warmup_s"] = time.monotonic() - began
        before = client.stats()
        t0 = time.monotonic() + 1.0  # every client connected and waiting by then
        deadline = t0 + args.duration + args.drain_limit
        sampler = StatsSampler(client, t0)
        sampler.start()
        records, client_errors = pool.run(server.address, t0, schedule, deadline)
        errors += client_errors
        wall = time.monotonic() - t0
        sampler.stopping.set()
        sampler.join(timeout=10)
        try:
            after = client.stats()
        except Exception as exc:  # the server died: say so, with its log, and report what was measured
            errors.append(f"no final Stats ({exc}); server log tail:\n{server.log_tail(4000)}")
            after = dict(before)
        hwm = proc_status_kb(server.pid, "VmHWM")
        workers_hwm = [proc_status_kb(kid, "VmHWM") or 0 for kid in children_of(server.pid)
                       if b"resource_tracker" not in _cmdline(kid)]  # decode workers, not spawn's helper
    finally:
        stopping = time.monotonic()
        exit_code = server.stop()
    phases["run_s"] = wall
    phases["stop_s"] = time.monotonic() - stopping
    leftovers = shm_leftovers(server.pid)
    if leftovers:
        errors.append(f"/dev/shm segments left by pid {server.pid}: {leftovers}")
    if exit_code != 0:
        errors.append(f"server exited with {exit_code}; log tail:\n{server.log_tail(2000)}")
    for e in errors:
        print(f"[{name}] ERROR: {e}", file=sys.stderr, flush=True)
    result = summarize(name, schedule, records, sampler.samples, before, after, hwm, workers_hwm, wall, args,
                       errors, leftovers, exit_code)
    result["phases_s"] = {k: round(v, 2) for k, v in phases.items()}
    return result


# ==================================================================== metrics

def pct(values, q) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def summarize(name, schedule, records, samples, before, after, hwm_kb, workers_hwm_kb, wall, args, errors,
              leftovers, exit_code) -> dict:
    spec = {r["i"]: r for r in schedule}
    kinds: dict[str, int] = {}
    for r in records:
        kinds[r.get("kind", "?")] = kinds.get(r.get("kind", "?"), 0) + 1
    done = [r for r in records if r.get("kind") == "completed" and r.get("usable")]
    first_arrival = min((spec[r["i"]]["t"] for r in records), default=0.0)
    last_result = max((r.get("received", 0.0) for r in records if r.get("kind") in ("completed", "canceled")),
                      default=first_arrival)
    span = max(1e-9, last_result - first_arrival)
    per_class = {}
    for steps in STEP_CLASSES:
        cls = [r for r in done if spec[r["i"]]["steps"] == steps]
        tt = [r["timings"]["total_s"] for r in cls]
        qd = [r["timings"]["queue_s"] for r in cls]
        dn = [r["timings"]["denoise_s"] for r in cls]
        dc = [r["timings"].get("decode_wait_s", 0.0) + r["timings"].get("decode_s", 0.0) for r in cls]
        sv = [r["timings"]["total_s"] - r["timings"]["queue_s"] for r in cls]
        per_class[str(steps)] = dict(
            completed=len(cls), ttuo_p50=pct(tt, 50), ttuo_p99=pct(tt, 99), queue_p50=pct(qd, 50),
            queue_p99=pct(qd, 99), denoise_p50=pct(dn, 50), decode_p50=pct(dc, 50), service_p50=pct(sv, 50),
            client_e2e_p50=pct([r["received"] - r["submitted"] for r in cls if "received" in r], 50))
    all_tt = sorted(r["timings"]["total_s"] for r in done)
    slow_index = args.clients  # the last client process
    slow = [r["received"] - r["submitted"] for r in done if r["client"] == slow_index and "received" in r]
    others = [r["received"] - r["submitted"] for r in done if r["client"] != slow_index and "received" in r]

    def delta(key):
        return int(after.get(key, 0)) - int(before.get(key, 0))

    useful, padded, canceled_evals = delta("useful_evals"), delta("padded_evals"), delta("canceled_evals")
    total = useful + padded
    busy_s = 0.0
    for a, b in zip(samples, samples[1:]):
        if a["busy"] > 0 or a["queue"] > 0:
            busy_s += b["t"] - a["t"]
    finished = kinds.get("completed", 0) + kinds.get("canceled", 0)
    arrivals = [spec[r["i"]]["t"] for r in records]
    arrival_rate = len(arrivals) / max(1e-9, max(arrivals, default=0.0)) if arrivals else 0.0
    service_rate = finished / busy_s if busy_s > 0 else 0.0
    # the queue instrument's fluid model holds the arrival rate constant: give it the arrival
    # window; the whole series, drain included, is `backlog_all`
    backlog_all = [[round(s["t"], 3), s["queue"]] for s in samples if s["t"] >= 0] or [[0.0, 0]]
    backlog = [pair for pair in backlog_all if pair[0] <= args.duration] or backlog_all[:1]
    return dict(
        name=name, admission=(CONFIGS[name] or ("batched", "pipeline"))[0],
        layout=(CONFIGS[name] or ("batched", "pipeline"))[1],
        arrival_rate=round(arrival_rate, 4), service_rate=round(service_rate, 4), initial_backlog=0,
        backlog=backlog, backlog_all=backlog_all,
        occupancy=[[round(s["t"], 3), round(s["busy"] / max(1, s["slots"]), 4)] for s in samples],
        requests=len(schedule), results=kinds, completed=len(done),
        goodput=len(done) / span, span_s=span, wall_s=wall, busy_s=busy_s,
        per_class=per_class, ttuo_all=all_tt,
        ttuo_short=sorted(r["timings"]["total_s"] for r in done if spec[r["i"]]["steps"] == STEP_CLASSES[0]),
        slow_client_e2e_p50=pct(slow, 50), other_clients_e2e_p50=pct(others, 50),
        useful_evals=useful, padded_evals=padded, total_evals=total, canceled_evals=canceled_evals,
        useful_ratio=useful / total if total else None,
        usable_evals=useful - canceled_evals,
        canceled_requests=delta("canceled_requests"),
        peak_rss_mb=(hwm_kb or 0) / 1024, decode_workers_peak_rss_mb=[kb / 1024 for kb in workers_hwm_kb],
        exit_code=exit_code, shm_leftovers=leftovers, errors=errors,
        records=[dict(r, steps=spec[r["i"]]["steps"], sampler=spec[r["i"]]["sampler"],
                      guidance=spec[r["i"]]["guidance"], arrival=spec[r["i"]]["t"]) for r in sorted(records, key=lambda r: r["i"])],
        late_submits=sum(1 for r in records if r["submitted"] - spec[r["i"]]["t"] > 0.05),
    )


# ==================================================================== engine overhead, in-process

def measure_overhead(model_path: str, slots: int, repeats: int, threads: int, quick: bool = False) -> list[dict]:
    """EngineCore in this process at `slots` slots, every slot busy with a mixed set (all
    four samplers, guidance 1/3/7.5, nobody finishing): time `core.step()` and, inside
    it, the denoiser call and the update kernel. Overhead = the rest (`_build_batch`,
    input gather, fence, per-slot bookkeeping, reaper, admission) over the denoiser."""
    import torch

    import engine.core as core_module
    from engine.core import CoreConfig, EngineCore
    from engine.model import load_model
    from engine.protocol import GenerateParams

    torch.set_num_threads(threads)
    model = load_model(model_path, "cpu")
    conditions = model.conditions[:-1]
    rows = []
    cases = [("compact", slots), ("compact", slots // 2), ("padded", slots), ("bucketed", slots)]
    for layout, active in cases[:2] if quick else cases:
        steps = repeats + 10
        core = EngineCore(model, CoreConfig(slots=slots, layout=layout, max_queue=slots, max_steps=steps))
        for i in range(active):
            core.add_request(f"o{i}", GenerateParams(condition=conditions[i % len(conditions)], steps=steps,
                                                     sampler=SAMPLERS[i % 4], guidance=GUIDANCES[i % 3], seed=i,
                                                     output="latent"))
        marks: dict[str, tuple[float, float]] = {}
        clock = time.perf_counter

        def wrap(key, fn):
            def timed(*a, **k):
                began = clock()
                try:
                    return fn(*a, **k)
                finally:
                    marks[key] = (began, clock())
            return timed

        update = core_module.update_slots
        core_module.update_slots = wrap("update", update)
        model.denoise = wrap("denoise", type(model).denoise.__get__(model))
        core._build_batch = wrap("build", core._build_batch)
        samples = []
        try:
            for k in range(repeats + 3):
                marks.clear()
                began = clock()
                core.step()
                total = clock() - began
                if k < 3:  # the first steps admit and warm up
                    continue
                (b0, b1), (d0, d1), (u0, u1) = marks["build"], marks["denoise"], marks["update"]
                build, gather, denoise, upd = b1 - b0, d0 - b1, d1 - d0, u1 - u0
                samples.append(dict(total=total, build=build, gather=gather, denoise=denoise, update=upd,
                                    rest=total - build - gather - denoise - upd, overhead=total - denoise - upd))
        finally:
            core_module.update_slots = update
            del model.denoise, core._build_batch
        med = {key: float(np.median([x[key] for x in samples])) * 1e3 for key in samples[0]}
        batch = core._build_batch(next(iter(core.groups.values())))
        rows.append(dict(layout=layout, slots=slots, active=active, rows=len(batch.row_slot),
                         step_ms=med["total"], build_ms=med["build"], gather_ms=med["gather"],
                         rest_ms=med["rest"], denoise_ms=med["denoise"], update_ms=med["update"],
                         overhead_ms=med["overhead"],
                         overhead_ratio=float(np.median([x["overhead"] / x["denoise"] for x in samples])),
                         repeats=len(samples)))
    return rows


# ==================================================================== output

def fmt(v, spec=".2f", none="-") -> str:
    return none if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def print_tables(results: dict, overhead: list[dict], meta: dict) -> None:
    print()
    print(f"mixed workload: {meta['requests']} requests, Poisson {meta['rate']:g}/s for {meta['duration']:g} s, "
          f"steps {'/'.join(map(str, STEP_CLASSES))}, {meta['slots']} slots, model {meta['model']}, "
          f"{meta['clients']} clients + 1 slow, seed {meta['seed']}")
    head = (f"{'config':<21}{'offered/s':>10}{'done':>6}{'canc':>6}{'rej':>5}{'fail':>5}{'goodput/s':>10}"
            f"{'service/s':>10}{'useful':>8}{'padded':>8}{'canc.ev':>8}{'useful%':>8}{'peakMB':>8}{'decMB':>7}")
    print(head)
    print("-" * len(head))
    for name, r in results.items():
        res = r["results"]
        fails = sum(v for k, v in res.items() if k not in ("completed", "canceled", "rejected"))
        print(f"{name:<21}{r['arrival_rate']:>10.2f}{r['completed']:>6}{res.get('canceled', 0):>6}"
              f"{res.get('rejected', 0):>5}{fails:>5}{r['goodput']:>10.2f}{r['service_rate']:>10.2f}"
              f"{r['useful_evals']:>8}{r['padded_evals']:>8}{r['canceled_evals']:>8}"
              f"{fmt(r['useful_ratio'] and 100 * r['useful_ratio'], '.1f'):>8}{r['peak_rss_mb']:>8.0f}"
              f"{sum(r['decode_workers_peak_rss_mb']):>7.0f}")
    print()
    print("time to usable output (arrival → PNG ready) and its parts, seconds, per step class")
    head = (f"{'config':<21}{'steps':>6}{'n':>5}{'TTUO p50':>10}{'p99':>8}{'queue p50':>10}{'p99':>8}"
            f"{'denoise p50':>12}{'decode p50':>11}{'client p50':>11}")
    print(head)
    print("-" * len(head))
    for name, r in results.items():
        for steps, c in r["per_class"].items():
            print(f"{name:<21}{steps:>6}{c['completed']:>5}{fmt(c['ttuo_p50']):>10}{fmt(c['ttuo_p99']):>8}"
                  f"{fmt(c['queue_p50']):>10}{fmt(c['queue_p99']):>8}{fmt(c['denoise_p50']):>12}"
                  f"{fmt(c['decode_p50'], '.3f'):>11}{fmt(c['client_e2e_p50']):>11}")
    print()
    print("slow client (reads each result --slow-read s late): client-side submit→result p50, s")
    for name, r in results.items():
        print(f"  {name:<21} slow {fmt(r['slow_client_e2e_p50'])}   others {fmt(r['other_clients_e2e_p50'])}")
    if overhead:
        print()
        print(f"engine overhead per step, in-process EngineCore, {overhead[0]['slots']} slots, ms "
              f"(median of {overhead[0]['repeats']} core.step() calls; overhead = step − denoiser − update =")
        print("build (_build_batch) + gather (input index_select, scale, cast) + rest (fence, per-slot "
              "bookkeeping, reaper, admission))")
        head = (f"{'layout':<10}{'active':>7}{'rows':>6}{'step':>9}{'denoiser':>10}{'update':>8}{'build':>7}"
                f"{'gather':>8}{'rest':>7}{'overhead':>10}{'ovh/denoiser':>14}")
        print(head)
        print("-" * len(head))
        for o in overhead:
            print(f"{o['layout']:<10}{o['active']:>7}{o['rows']:>6}{o['step_ms']:>9.2f}{o['denoise_ms']:>10.2f}"
                  f"{o['update_ms']:>8.2f}{o['build_ms']:>7.2f}{o['gather_ms']:>8.2f}{o['rest_ms']:>7.2f}"
                  f"{o['overhead_ms']:>10.2f}{100 * o['overhead_ratio']:>13.1f}%")


def targets(results: dict, overhead: list[dict]) -> dict:
    out = {}
    a, b = results.get("continuous+compact"), results.get("static+padded")
    if a and b:
        short = str(STEP_CLASSES[0])
        pa, pb = a["per_class"][short]["ttuo_p50"], b["per_class"][short]["ttuo_p50"]
        out["goodput_ratio"] = a["goodput"] / b["goodput"] if b["goodput"] else None
        out["short_ttuo_p50_ratio"] = pb / pa if pa and pb else None
        sa, sb = a["per_class"][short]["service_p50"], b["per_class"][short]["service_p50"]
        out["short_service_p50_ratio"] = sb / sa if sa and sb else None  # TTUO less queue delay
        out["compact_padded_evals"] = a["padded_evals"]
    full = [o for o in overhead if o["layout"] == "compact" and o["active"] == o["slots"]]
    if full:
        out["overhead_ratio_compact_full"] = full[0]["overhead_ratio"]
    return out


def print_targets(t: dict) -> None:
    print()
    print("targets (reported, not asserted):")

    def line(label, value, goal, ok):
        print(f"  {label:<58}{value:>10}   goal {goal:<8} {'met' if ok else 'MISSED'}")

    if "goodput_ratio" in t:
        g = t["goodput_ratio"]
        line("goodput, continuous+compact / static+padded", fmt(g, ".2f") + "x", ">= 1.3x", g is not None and g >= 1.3)
        s = t["short_ttuo_p50_ratio"]
        line(f"p50 TTUO of {STEP_CLASSES[0]}-step requests, static+padded / continuous+compact",
             fmt(s, ".2f") + "x", ">= 3x", s is not None and s >= 3)
        v = t["short_service_p50_ratio"]
        print(f"    (the same without queue delay, denoise + decode only: {fmt(v, '.2f')}x)")
        line("padded evaluations of continuous+compact", str(t["compact_padded_evals"]), "0",
             t["compact_padded_evals"] == 0)
    if "overhead_ratio_compact_full" in t:
        o = t["overhead_ratio_compact_full"]
        line("engine overhead / denoiser time, compact, all slots busy", fmt(100 * o, ".1f") + "%", "<= 10%",
             o <= 0.10)


def write_plot(path: pathlib.Path, results: dict, meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(1, len(results))
    fig = plt.figure(figsize=(17, 1.2 * n + 3.2))
    grid = fig.add_gridspec(n, 3, width_ratios=(1.1, 1.2, 1.0), hspace=0.15, wspace=0.25)
    colors = dict(zip(CONFIGS, ("tab:red", "tab:orange", "tab:green", "tab:blue", "tab:purple")))
    ax = fig.add_subplot(grid[:, 0])
    for name, r in results.items():
        for values, style in ((r["ttuo_all"], dict(label=name)), (r["ttuo_short"], dict(linestyle=":", linewidth=1))):
            if values:
                x = np.concatenate([[values[0]], values])
                y = np.arange(0, len(values) + 1) / len(values)
                ax.step(x, y, where="post", color=colors.get(name), **style)
    ax.set_xscale("log")
    ax.set_xlabel("time to usable output, s (log)")
    ax.set_ylabel("fraction of completed requests")
    ax.set_title(f"TTUO CDF (solid: all, dotted: {STEP_CLASSES[0]}-step)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="lower right")
    end_t = max((r["occupancy"][-1][0] for r in results.values() if r["occupancy"]), default=1.0)
    first = None
    for k, (name, r) in enumerate(results.items()):
        ax = fig.add_subplot(grid[k, 1], sharex=first)
        first = first or ax
        occ = np.array(r["occupancy"]) if r["occupancy"] else np.zeros((0, 2))
        if len(occ):
            ax.fill_between(occ[:, 0], occ[:, 1], step="post", color=colors.get(name), alpha=0.35, linewidth=0)
            ax.step(occ[:, 0], occ[:, 1], where="post", color=colors.get(name), linewidth=0.8)
            ax.text(0.99, 0.8, f"{name}: mean {occ[:, 1].mean():.0%}", transform=ax.transAxes, ha="right",
                    fontsize=8)
        ax.axvline(meta["duration"], color="grey", linestyle="--", linewidth=0.8)
        ax.set_ylim(0, 1.05)
        ax.set_xlim(0, end_t)
        ax.set_yticks([0, 1])
        ax.grid(alpha=0.3)
        if k == 0:
            ax.set_title("slot occupancy: busy slots / slots (dashed: arrivals stop)")
        if k < n - 1:
            ax.tick_params(labelbottom=False)
        else:
            ax.set_xlabel("time since the arrival window opened, s")
    ax = fig.add_subplot(grid[:, 2])
    for name, r in results.items():
        b = np.array(r["backlog_all"])
        ax.plot(b[:, 0], b[:, 1], label=name, color=colors.get(name), linewidth=1)
    ax.axvline(meta["duration"], color="grey", linestyle="--", linewidth=0.8)
    ax.set_xlabel("time since the arrival window opened, s")
    ax.set_ylabel("queued requests (waiting for a slot)")
    ax.set_title("backlog (Stats queue_depth every 0.2 s)")
    ax.grid(alpha=0.3)
    fig.suptitle(f"mixed workload, {meta['model']} model, {meta['slots']} slots, {meta['rate']:g} req/s offered, "
                 f"{meta['machine']}", fontsize=10)
    fig.subplots_adjust(left=0.05, right=0.98, top=0.88, bottom=0.1)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ==================================================================== main

def resolve_model(name: str, tmp: pathlib.Path) -> tuple[str, str]:
    """(model folder, label). `shapes` falls back to the tiny random-weight test model, with
    a printed note, while its trained weights are missing; `tiny` is that model saved as a folder."""
    from engine.models import resolve

    if name != "tiny":
        try:
            return str(resolve(name)), name
        except FileNotFoundError as exc:
            if name != "shapes":
                raise
            print(f"note: the trained shapes model is not available ({exc}); "
                  "falling back to the tiny random-weight test model", flush=True)
    from tests.reference import tiny_model

    model = tiny_model("epsilon", seed=0, with_vae=True)
    folder = tmp / "tiny-model"
    model.unet.save_pretrained(folder / "unet")
    model.vae.save_pretrained(folder / "vae")
    (folder / "scheduler").mkdir(parents=True, exist_ok=True)
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(model.scheduler_config))
    (folder / "conditions.json").write_text(json.dumps(model.conditions))
    return str(folder), "tiny"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="shapes", help="'shapes' (default; tiny fallback), 'tiny', or a folder")
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--rate", type=float, default=None, help="offered requests/s (default 5, quick 3)")
    ap.add_argument("--duration", type=float, default=None, help="seconds of arrivals (default 30, quick 5)")
    ap.add_argument("--clients", type=int, default=3, help="client processes besides the slow one")
    ap.add_argument("--slow-read", type=float, default=0.5, help="the slow client's delay per result, s")
    ap.add_argument("--cancel-share", type=float, default=0.3, help="share of 50-step requests canceled")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--decode-workers", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of the server process (default: CPUs − 1, at least 1)")
    ap.add_argument("--max-queue", type=int, default=None, help="engine --max-queue (default: the whole schedule)")
    ap.add_argument("--drain-limit", type=float, default=None, help="seconds allowed after arrivals end")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ", ".join(CONFIGS))
    ap.add_argument("--no-prestart", dest="prestart", action="store_false",
                    help="start each server just before its turn (default: all at once at the beginning; "
                         "idle servers sleep, so their start-up overlaps but runs never do)")
    ap.add_argument("--quick", action="store_true", help="CI smoke: short run, fewer overhead repeats")
    ap.add_argument("--overhead-repeats", type=int, default=None)
    ap.add_argument("--no-overhead", action="store_true", help="skip the in-process overhead table")
    ap.add_argument("--json", type=pathlib.Path, default=REPO / "bench" / "results" / "workload.json")
    ap.add_argument("--plot", type=pathlib.Path, default=REPO / "bench" / "results" / "workload.png")
    ap.add_argument("--serve-baseline", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.serve_baseline:
        import logging

        logging.basicConfig(level=logging.WARNING)
        return serve_baseline(args.address, args.model, args.slots)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        print(f"error: unknown configuration(s) {unknown}; known: {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    args.rate = args.rate or (3.0 if args.quick else 5.0)
    args.duration = args.duration or (5.0 if args.quick else 30.0)
    args.drain_limit = args.drain_limit or (60.0 if args.quick else 240.0)
    args.threads = args.threads or max(1, (os.cpu_count() or 2) - 1)
    repeats = args.overhead_repeats or (5 if args.quick else 40)

    from engine import transport

    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # unwind through `finally`: reap the servers
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="wl-", dir=transport.runtime_dir()))
    pool, servers, keep = None, [], False
    try:
        args.model_path, model_label = resolve_model(args.model, tmp)
        conditions = json.loads((pathlib.Path(args.model_path) / "conditions.json").read_text())[:-1]
        total_clients = args.clients + 1
        schedule = make_schedule(args.seed, args.rate, args.duration, total_clients, conditions, args.cancel_share)
        args.max_queue = args.max_queue or max(64, len(schedule) + 32)
        meta = dict(model=model_label, model_path=args.model_path, slots=args.slots, rate=args.rate,
                    duration=args.duration, seed=args.seed, clients=args.clients, slow_read_s=args.slow_read,
                    cancel_share=args.cancel_share, decode_workers=args.decode_workers, threads=args.threads,
                    requests=len(schedule), quick=args.quick,
                    step_classes={str(s): sum(1 for r in schedule if r["steps"] == s) for s in STEP_CLASSES},
                    cancels=sum(1 for r in schedule if r["cancel_at"] is not None),
                    machine=f"{os.cpu_count()} CPU cores, no GPU" if not _has_cuda_device() else "GPU present",
                    platform=platform.platform(), python=platform.python_version(),
                    date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    command="python bench/workload.py " + " ".join(sys.argv[1:] if argv is None else argv))
        print(f"schedule: {len(schedule)} requests over {args.duration:g} s at {args.rate:g}/s "
              f"({meta['step_classes']} by steps, {meta['cancels']} to cancel), "
              f"{args.clients} clients + 1 slow; model {model_label}", flush=True)
        servers = [Server(name, args, tmp) for name in names]
        if args.prestart:  # start-up overlaps; idle servers sleep until their turn
            for server in servers:
                server.start()
        pool = ClientPool(total_clients, args.slow_read)
        results, failed = {}, []
        for server in servers:
            name = server.name
            if server.process is None:
                server.start()
            try:
                r = run_config(server, args, schedule, pool, conditions)
            except Exception:
                failed.append(name)
                print(f"[{name}] FAILED:\n{traceback.format_exc()}\nserver log tail:\n{server.log_tail(6000)}",
                      file=sys.stderr, flush=True)
                continue
            results[name] = r
            print(f"[{name}] {r['completed']} completed, goodput {r['goodput']:.2f}/s, "
                  f"{r['results']}; phases {r['phases_s']}", flush=True)
        pool.close()
        pool = None
        overhead = [] if args.no_overhead else measure_overhead(args.model_path, OVERHEAD_SLOTS, repeats,
                                                                args.threads, args.quick)
        print_tables(results, overhead, meta)
        t = targets(results, overhead)
        print_targets(t)
        report = dict(meta=meta, configs=results, overhead=overhead, targets=t)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1, default=float))
        print(f"\nwrote {args.json}")
        if args.plot:
            write_plot(args.plot, results, meta)
            print(f"wrote {args.plot}")
        bad = failed + [n for n, r in results.items() if r["errors"]]
        if bad:
            keep = True
            print(f"errors in: {', '.join(bad)}", file=sys.stderr)
            return 1
        return 0
    except BaseException:
        keep = True
        raise
    finally:
        if pool is not None:
            pool.close()
        for server in servers:
            server.stop()
        if keep:
            print(f"server logs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def _has_cuda_device() -> bool:
    return os.path.exists("/dev/nvidia0")


if __name__ == "__main__":
    sys.exit(main())
