"""The workload's arrival schedule and the client processes that replay it.

`make_schedule` draws one seeded schedule (Poisson arrivals or a burst) that every system
replays (`with_output` sends the same schedule with another output kind); `ClientPool`
keeps `n` client processes (multiprocessing spawn, one `frontend.Client` each, the last one
slow: its IO thread waits before taking each result, so results pile up in the engine's
per-client backlog) across all runs; `usable` judges a result (a PNG of the expected size,
or a finite float32 latent of the expected shape); `StatsSampler` polls the engine's Stats;
`warm_up` makes a fresh engine ready; `idle_latency` times single shortest-class requests
sent one at a time to an idle engine. Torch-free: client processes import this module.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue as queue_module
import struct
import threading
import time
import traceback

import numpy as np

MIXED_SAMPLERS = ("euler", "euler_ancestral", "ddim", "dpmpp_2m")
GUIDANCES = (1.0, 3.0, 7.5)
STEP_SHARES = (0.4, 0.35, 0.25)  # of the three step classes, shortest first
STATS_INTERVAL_S = 0.2
OUTPUTS = ("png", "latent")  # the output kinds a workload's requests ask for
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def make_schedule(seed: int, rate: float | None, duration: float, clients: int, prompts: list[str],
                  step_classes: tuple[int, ...], cancel_share: float, count: int | None = None,
                  output: str = "png") -> list[dict]:
    """The seeded schedule: Poisson arrivals at `rate` for `duration` s, or (rate None) a
    burst of `count` requests at t = 0. `clients` counts the slow client (the last index).
    A share of the longest class is canceled by its client at a step drawn uniformly.
    Every request asks for `output` (png or latent); the draws do not depend on it."""
    if output not in OUTPUTS:
        raise ValueError(f"output must be one of {OUTPUTS}, not {output!r}")
    rng = np.random.default_rng(seed)
    t, requests = 0.0, []
    while True:
        if rate is None:
            if len(requests) >= count:
                break
        else:
            t += rng.exponential(1.0 / rate)
            if t > duration:
                break
        shares = np.array(STEP_SHARES[:len(step_classes)])
        steps = int(rng.choice(step_classes, p=shares / shares.sum()))
        cancel_at = None
        if steps == max(step_classes) and rng.random() < cancel_share:
            cancel_at = int(rng.integers(1, steps))
        requests.append(dict(
            i=len(requests), t=round(float(t), 4), client=int(rng.integers(clients)),
            prompt=str(prompts[rng.integers(len(prompts))]), steps=steps,
            sampler=str(MIXED_SAMPLERS[rng.integers(len(MIXED_SAMPLERS))]), guidance=float(GUIDANCES[rng.integers(len(GUIDANCES))]),
            seed=int(rng.integers(2**31)), cancel_at=cancel_at, output=output))
    return requests


def with_output(schedule: list[dict], output: str) -> list[dict]:
    """The same schedule (arrivals, prompts, steps, seeds, cancels) asking for `output`."""
    if output not in OUTPUTS:
        raise ValueError(f"output must be one of {OUTPUTS}, not {output!r}")
    return [dict(spec, output=output) for spec in schedule]


def usable(result, output: str, expect: dict | None) -> bool:
    """Whether a result is a usable output of the kind asked for: a Completed whose output is
    PNG bytes (signature, and an IHDR of the expected width × height when `expect` has
    `size`), or a float32 numpy array of the expected latent shape (`expect["latent_shape"]`),
    every value finite and not all equal (a zero-filled buffer is not a latent)."""
    from frontend import Completed

    if not isinstance(result, Completed):
        return False
    out, expect = result.output, expect or {}
    if output == "png":
        if not isinstance(out, bytes) or out[:8] != PNG_SIGNATURE or out[12:16] != b"IHDR" or len(out) < 24:
            return False
        size = expect.get("size")  # (height, width)
        return size is None or struct.unpack(">II", out[16:24]) == (int(size[1]), int(size[0]))
    if output == "latent":
        if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.ndim != 3 or out.size == 0:
            return False
        shape = expect.get("latent_shape")
        if shape is not None and tuple(out.shape) != tuple(int(d) for d in shape):
            return False
        return bool(np.isfinite(out).all()) and float(out.max()) > float(out.min())
    return False


# ---- client processes ----------------------------------------------------------------------

def _slow_client_class():
    from engine.protocol import Heartbeat
    from frontend import Client

    class SlowClient(Client):
        """Reads its results late: before taking a frame with an output attached its IO
        thread waits `read_delay` s (heartbeats continue: slow, not dead)."""

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
                   deadline: float, tag: str, expect: dict | None = None) -> list[dict]:
    """One client's share of a schedule: submit each request at t0 + its time (asking for its
    `output`), cancel the marked ones at their step, collect every result and judge it
    (`usable`, against `expect`)."""
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
            params = GenerateParams(prompt=spec["prompt"], steps=spec["steps"], sampler=spec["sampler"],
                                    guidance=spec["guidance"], seed=spec["seed"], output=spec.get("output", "png"))
            record = dict(i=spec["i"], client=index, steps=spec["steps"], output=params.output,
                          submitted=time.monotonic() - t0)
            try:
                handle = client.submit(params, request_id=f"{tag}{spec['i']}", progress=spec["cancel_at"] is not None)
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
                    record["usable"] = usable(result, record["output"], expect)
                for field in ("reason", "error"):
                    if hasattr(result, field):
                        record["reason"] = getattr(result, field)
            records.append(record)
        if any(r["kind"] == "timeout" for r in records):
            time.sleep(0.5)  # let the cancels of timed-out requests leave before Goodbye
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
    """`n` client processes (the last one slow), kept across runs."""

    def __init__(self, n: int, slow_read_s: float):
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(n)]
        self.procs = [ctx.Process(target=client_main, name=f"workload-client-{i}", daemon=True,
                                  args=(i, slow_read_s if i == n - 1 else 0.0, self.commands[i], self.results))
                      for i in range(n)]
        for p in self.procs:
            p.start()

    def run(self, address: str, t0: float, schedule: list[dict], deadline: float,
            tag: str, expect: dict | None = None) -> tuple[list[dict], list[str]]:
        """Every client replays its share of `schedule` (each request asks for its own
        `output`); results are judged against `expect` (see `usable`)."""
        for i, commands in enumerate(self.commands):
            commands.put(dict(address=address, t0=t0, deadline=deadline, tag=tag, expect=expect,
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


class StatsSampler(threading.Thread):
    """Stats every STATS_INTERVAL_S: queue depth (backlog) and busy slots (occupancy)."""

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
            except Exception:  # the engine is gone
                return
            if s is not None:
                self.samples.append(dict(t=time.monotonic() - self.t0, queue=int(s.get("queue_depth", 0)),
                                         busy=int(s.get("slots_busy", 0)), slots=int(s.get("slots", 1))))
            next_at += STATS_INTERVAL_S
            self.stopping.wait(max(0.0, next_at - time.monotonic()))


def warm_up(client, prompt: str, step_classes: tuple[int, ...], output: str = "png") -> None:
    """One short request per sampler (model, decode path, allocator warm), and every
    (sampler, steps) of the workload submitted once and canceled (schedules built), all
    asking for `output`."""
    from frontend import GenerateParams

    handles = []
    for k, sampler in enumerate(MIXED_SAMPLERS):
        handles.append(client.submit(GenerateParams(prompt=prompt, steps=min(step_classes), sampler=sampler,
                                                    guidance=GUIDANCES[k % 3], seed=k, output=output),
                                     progress=False))
        for steps in step_classes[1:]:
            h = client.submit(GenerateParams(prompt=prompt, steps=steps, sampler=sampler, seed=k,
                                             output=output), progress=False)
            h.accepted(60)
            h.cancel()
            handles.append(h)
    for h in handles:
        result = h.result(timeout=300)
        if type(result).__name__ not in ("Completed", "Canceled"):
            raise RuntimeError(f"warm-up request ended with {result!r}")


def idle_latency(client, prompts: list[str], steps: int, output: str, expect: dict | None, n: int = 5,
                 seed: int = 0, timeout_s: float = 120.0) -> dict:
    """The idle short latency: `n` single `steps`-step requests (samplers and guidance of the
    mix in turn) sent one at a time to an idle engine, each after the last one's result.
    Per request: the engine's time to usable output (`Timings.total_s`, as in the runs) and
    whether it was usable; `median_s` is over the usable ones (None when none was)."""
    from frontend import GenerateParams

    rng = np.random.default_rng(seed)
    samples = []
    for k in range(n):
        params = GenerateParams(prompt=str(prompts[rng.integers(len(prompts))]), steps=steps,
                                sampler=MIXED_SAMPLERS[k % len(MIXED_SAMPLERS)], guidance=GUIDANCES[k % len(GUIDANCES)],
                                seed=int(rng.integers(2**31)), output=output)
        began = time.monotonic()
        result = client.submit(params, progress=False).result(timeout=timeout_s)
        timings = getattr(result, "timings", None)
        samples.append(dict(kind=type(result).__name__.lower(), usable=usable(result, output, expect),
                            total_s=getattr(timings, "total_s", None), client_s=time.monotonic() - began,
                            sampler=params.sampler, guidance=params.guidance))
    good = sorted(s["total_s"] for s in samples if s["usable"] and s["total_s"] is not None)
    return dict(steps=steps, output=output, n=n, usable=len(good), samples=samples,
                median_s=float(np.median(good)) if good else None)
