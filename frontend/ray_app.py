"""The images API over Ray Serve replicas, each owning one engine process.

    python -m frontend.ray_app --replicas 4 --model shapes --slots 16 --port 8000
    python -m frontend.ray_app --replicas 8 --address auto          # join a running Ray cluster
    serve run frontend.ray_app:app_builder replicas=2 model=shapes  # Ray's own CLI

Each replica (`EngineReplica`) starts `python -m engine serve` on a private ipc
socket, connects an `EngineLink` to it, and serves the same FastAPI app as `python -m
frontend http` (`frontend.http.app.create_app`) as its ingress; Ray Serve's proxy
routes HTTP requests among replicas. Where the cluster has GPUs, each replica asks
for one (`num_gpus=1`) and its engine sees only that one (Ray sets
CUDA_VISIBLE_DEVICES for the replica, and the engine inherits it).

* An HTTP client that disconnects: Ray's proxy cancels the replica call; the
  handler's cancellation cancels its engine requests (AsyncClient.generate).
* An engine that dies: the replica's in-flight requests fail with 503 at once
  (EngineDeadError), `check_health` raises, and Ray replaces the replica (a new
  replica starts a new engine).
* A replica that dies (killed outright, or by Ray past its graceful shutdown): its
  engine gets SIGINT through PR_SET_PDEATHSIG (`frontend/parent_death.py`) and stops
  at once, freeing the GPU for the replacement, rather than draining. A replica
  stopped gracefully drains its engine (SIGTERM) for at most `engine_drain_s`; one
  whose engine is already unreachable stops it at once.
* Gateway options (`api_keys`, `max_body_bytes`, `rate_limit`, `rate_burst`) apply per
  replica: each replica has its own rate buckets, so a caller's rate over the whole
  application is up to `replicas` × the limit. API keys come from `--api-key` or
  DIFFSLOT_API_KEYS in the driver's environment.

Ray's own ports (GCS 6379, the dashboard 8265, the client server 10001, the nodes'
workers) accept jobs: whoever reaches them runs arbitrary code on the cluster. Keep
them on a private network (docs/deploy.md); only the Serve proxy's HTTP port is for
clients.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid

from ray import serve

from frontend.launcher import serve_command, stop_process
from frontend import parent_death
from frontend.http.app import create_app
from frontend.http.callers import api_keys as keys_from
from frontend.http.link import EngineLink

log = logging.getLogger("diffslot.ray")

ENGINE_DRAIN_S = 10.0  # a gracefully stopped replica's engine finishes in-flight work for at most this


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt()


@serve.ingress()
class EngineReplica:
    """One Ray Serve replica: an engine process and the HTTP API in front of it."""

    async def __init__(self, engine_args: list[str], *, model_name: str | None = None,
                       socket_dir: str | None = None, ready_timeout_s: float = 600.0,
                       engine_command: list[str] | None = None, gateway: dict | None = None,
                       engine_drain_s: float = ENGINE_DRAIN_S):
        self.gateway = dict(gateway or {})  # create_app's options
        self.engine_drain_s = engine_drain_s
        self._own_dir = socket_dir is None
        self.dir = pathlib.Path(socket_dir or tempfile.mkdtemp(prefix="dsr-", dir="/tmp"))
        self.dir.mkdir(parents=True, exist_ok=True)
        tag = uuid.uuid4().hex[:8]
        self.address = f"ipc://{self.dir / f'engine-{tag}.sock'}"
        self.log_path = self.dir / f"engine-{tag}.log"
        command = [*engine_command, "--address", self.address, *engine_args] if engine_command \
            else serve_command(self.address, *engine_args)
        self._log = open(self.log_path, "wb")
        # started on this (the replica's event loop) thread, which lives as long as the replica:
        # PDEATHSIG fires when the starting thread exits. Its own session: a signal meant for the
        # replica's process group (a terminal's Ctrl-C) does not reach it.
        self.engine = subprocess.Popen(parent_death.command(command), stdout=subprocess.DEVNULL, stderr=self._log,
                                       start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.link = EngineLink(self.address, model_name=model_name)
        self.link.start()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ready_timeout_s
        while not self.link.connected:
            if self.engine.poll() is not None:
                await self._stop_engine()
                raise RuntimeError(f"engine exited with {self.engine.returncode} before it was ready:\n"
                                   f"{self.engine_log()}")
            if loop.time() > deadline:
                await self._stop_engine()
                raise TimeoutError(f"engine not ready within {ready_timeout_s:g}s:\n{self.engine_log()}")
            await asyncio.sleep(0.1)
        log.info("replica ready: engine pid %d on %s", self.engine.pid, self.address)

    def __serve_build_asgi_app__(self):
        return create_app(self.link, own_link=False, **self.gateway)

    async def check_health(self) -> None:
        """Ray calls this every `health_check_period_s`; raising gets the replica replaced."""
        code = self.engine.poll()
        if code is not None:
            raise RuntimeError(f"engine process {self.engine.pid} exited with {code}")
        if not self.link.connected:
            raise RuntimeError(f"engine at {self.address} is unreachable")

    def engine_log(self) -> str:
        try:
            self._log.flush()
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    async def _stop_engine(self) -> None:
        # a healthy engine drains what is in flight; one that no longer answers is stopped at once
        # (the second SIGTERM), so that it does not hold the GPU while Ray starts the replacement
        drain_s = self.engine_drain_s if self.link.connected else 0.5
        await self.link.close()
        await asyncio.get_running_loop().run_in_executor(None, stop_process, self.engine, drain_s)
        self._log.close()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    async def __del__(self):
        """Ray Serve calls this when it stops the replica: stop the engine (SIGTERM drains it)."""
        if hasattr(self, "engine"):
            await self._stop_engine()


def engine_arguments(model: str = "shapes", slots: int = 8, decode_workers: int = 1, device: str | None = None,
                     extra: list[str] | None = None) -> list[str]:
    args = ["--model", str(model), "--slots", str(slots), "--decode-workers", str(decode_workers)]
    if device:
        args += ["--device", device]
    return args + list(extra or [])


def build_app(*, model: str = "shapes", replicas: int = 1, slots: int = 8, decode_workers: int = 1,
              gpus_per_replica: float | None = None, cpus_per_replica: float = 1.0, model_name: str | None = None,
              max_ongoing_requests: int = 256, health_check_period_s: float = 2.0,
              health_check_timeout_s: float = 30.0, socket_dir: str | None = None,
              engine_extra: list[str] | None = None, engine_command: list[str] | None = None,
              api_keys: list[str] | tuple[str, ...] = (), max_body_bytes: int | None = None,
              rate_limit: float = 0.0, rate_burst: float | None = None, engine_drain_s: float = ENGINE_DRAIN_S):
    """The Serve application: `replicas` EngineReplicas. `gpus_per_replica` None: one
    GPU each if the cluster has GPUs, else none (engines then run on CPU). The gateway
    options are create_app's, applied in every replica."""
    import ray

    if gpus_per_replica is None:
        gpus_per_replica = 1.0 if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= 1 else 0.0
    # with a GPU, say so; without, let the engine choose (Ray hides the GPUs of a replica
    # that asked for none, so it runs on the CPU)
    device = "cuda" if gpus_per_replica else None
    actor_options = {"num_cpus": cpus_per_replica}
    if gpus_per_replica:
        actor_options["num_gpus"] = gpus_per_replica
    deployment = serve.deployment(
        EngineReplica, name="diffslot", num_replicas=replicas, ray_actor_options=actor_options,
        # the engine batches: let many requests reach one replica at a time
        max_ongoing_requests=max_ongoing_requests,
        health_check_period_s=health_check_period_s, health_check_timeout_s=health_check_timeout_s,
        # past this Ray kills the replica, and PDEATHSIG stops its engine at once
        graceful_shutdown_timeout_s=engine_drain_s + 15.0)
    gateway = {"api_keys": tuple(api_keys), "rate_limit": rate_limit, "rate_burst": rate_burst}
    if max_body_bytes is not None:
        gateway["max_body_bytes"] = max_body_bytes
    return deployment.bind(engine_arguments(model, slots, decode_workers, device, engine_extra),
                           model_name=model_name, socket_dir=socket_dir, engine_command=engine_command,
                           gateway=gateway, engine_drain_s=engine_drain_s)


def app_builder(args: dict):
    """For `serve run frontend.ray_app:app_builder replicas=2 model=shapes slots=8`. API keys
    come from DIFFSLOT_API_KEYS, not arguments (which show in process lists)."""
    gpus = args.get("gpus_per_replica")
    max_body = args.get("max_body_bytes")
    burst = args.get("rate_burst")
    return build_app(model=args.get("model", "shapes"), replicas=int(args.get("replicas", 1)),
                     slots=int(args.get("slots", 8)), decode_workers=int(args.get("decode_workers", 1)),
                     gpus_per_replica=None if gpus is None else float(gpus),
                     cpus_per_replica=float(args.get("cpus_per_replica", 1.0)), model_name=args.get("model_name"),
                     api_keys=keys_from(), max_body_bytes=None if max_body is None else int(max_body),
                     rate_limit=float(args.get("rate_limit", 0.0)), rate_burst=None if burst is None else float(burst))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m frontend.ray_app",
                                 description="the diffslot images API over Ray Serve replicas, one engine each")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--model", default="shapes", help="shapes or a model folder (on every node)")
    ap.add_argument("--model-name", default=None, help="the model id to advertise")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--decode-workers", type=int, default=1)
    ap.add_argument("--gpus-per-replica", type=float, default=None,
                    help="default: 1 if the cluster has GPUs, else 0")
    ap.add_argument("--cpus-per-replica", type=float, default=1.0)
    ap.add_argument("--host", default="127.0.0.1", help="the HTTP proxy's interface (0.0.0.0 to expose it)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--address", default=None,
                    help="Ray cluster to join ('auto': the local node's cluster); default: start a local one")
    ap.add_argument("--api-key", action="append", default=[], metavar="KEY", dest="api_keys",
                    help="require 'Authorization: Bearer KEY' on /v1 routes (repeatable; also DIFFSLOT_API_KEYS)")
    ap.add_argument("--max-body-bytes", type=int, default=None, metavar="B", help="largest request body (1 MiB)")
    ap.add_argument("--rate-limit", type=float, default=0.0, metavar="R",
                    help="requests per second per caller, per replica; 0 = no limit")
    ap.add_argument("--rate-burst", type=float, default=None, metavar="N")
    args = ap.parse_args(argv)

    import ray

    # the deployment class must be pickled by reference (as frontend.ray_app.EngineReplica), not
    # by value from __main__, which would drag this module's globals along
    from frontend.ray_app import build_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    ray.init(address=args.address)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_app(model=args.model, replicas=args.replicas, slots=args.slots,
                            decode_workers=args.decode_workers, gpus_per_replica=args.gpus_per_replica,
                            cpus_per_replica=args.cpus_per_replica, model_name=args.model_name,
                            api_keys=keys_from(args.api_keys), max_body_bytes=args.max_body_bytes,
                            rate_limit=args.rate_limit, rate_burst=args.rate_burst),
                  name="diffslot", route_prefix="/")
        print(f"diffslot images API on http://{args.host}:{args.port}/v1 ({args.replicas} replicas); "
              "Ctrl-C stops it", flush=True)
        signal.signal(signal.SIGTERM, _raise_interrupt)
        while True:
            signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        try:
            serve.delete("diffslot")
            if args.address is None:
                serve.shutdown()
        finally:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
