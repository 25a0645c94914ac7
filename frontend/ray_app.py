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
* Gateway limits (`GatewayLimits`: API keys, body size, rate, priority classes) apply
  per replica: each replica has its own rate buckets, so a caller's rate over the whole
  application is up to `replicas` × the limit. API keys come from `--api-key` or
  DIFFSLOT_API_KEYS in the driver's environment, priority classes from `--key-class` or
  DIFFSLOT_KEY_CLASSES.
* The Batch API: every replica serves it from one state dir (`--state-dir`, SQLite), and
  each replica's batch runner claims lines from it, so one job's lines spread over the
  replicas and a replica that dies has its lines run by the others. SQLite wants a local
  filesystem: replicas must share a node (or a filesystem with working POSIX locks);
  outputs may go to S3 (`--output-store s3://...`) either way.

Ray's own ports (GCS 6379, the dashboard 8265, the client server 10001, the nodes'
workers) accept jobs: whoever reaches them runs arbitrary code on the cluster. Keep
them on a private network (docs/deploy.md); only the Serve proxy's HTTP port is for
clients.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
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

from engine.flags import add_config_arguments, cli, config_from_args, config_from_mapping
from frontend import parent_death
from frontend.http.app import create_app
from frontend.http.callers import api_keys as keys_from
from frontend.http.link import EngineLink
from frontend.http.options import BatchOptions, GatewayLimits, ServerOptions, StoreOptions
from frontend.http.priorities import key_class_specs
from frontend.launcher import serve_command, stop_process

log = logging.getLogger("diffslot.ray")

ENGINE_DRAIN_S = 10.0  # a gracefully stopped replica's engine finishes in-flight work for at most this
# the gateway limits a replica takes from the command line (and from `serve run`'s key=value arguments)
REPLICA_LIMITS = ("api_keys", "max_body_bytes", "rate_limit", "rate_burst", "key_classes", "max_file_bytes")


@dataclasses.dataclass
class AppConfig:
    """The Serve application (`build_app`): its replicas and each one's engine."""

    model: str = dataclasses.field(default="shapes", metadata=cli(
        "--model", help="shapes, a model folder or single file (on every node), or a hub id"))
    lora_dir: str | None = dataclasses.field(default=None, metadata=cli(
        "--lora-dir", metavar="DIR", help="each engine's --lora-dir: the LoRA adapters it serves (on every node)"))
    replicas: int = dataclasses.field(default=1, metadata=cli("--replicas", help="replicas, one engine each"))
    slots: int = dataclasses.field(default=8, metadata=cli("--slots", help="each engine's --slots"))
    decode_workers: int = dataclasses.field(default=1, metadata=cli(
        "--decode-workers", help="each engine's --decode-workers"))
    gpus_per_replica: float | None = dataclasses.field(default=None, metadata=cli(
        "--gpus-per-replica", help="default: 1 if the cluster has GPUs, else 0"))
    cpus_per_replica: float = dataclasses.field(default=1.0, metadata=cli(
        "--cpus-per-replica", help="Ray CPUs each replica asks for"))
    model_name: str | None = dataclasses.field(default=None, metadata=cli(
        "--model-name", help="the model id to advertise (default: the engine's model name)"))
    max_ongoing_requests: int = 256  # requests Ray lets reach one replica at once: the engine batches them
    health_check_period_s: float = 2.0
    health_check_timeout_s: float = 30.0
    socket_dir: str | None = None  # where the engines' ipc sockets go (default: a fresh directory per replica)
    engine_extra: list[str] = dataclasses.field(default_factory=list)  # more `python -m engine serve` flags
    engine_command: list[str] | None = None  # instead of `python -m engine serve` (tests)
    engine_drain_s: float = ENGINE_DRAIN_S


@dataclasses.dataclass
class DriverOptions:
    """`python -m frontend.ray_app`'s own flag: the Ray cluster it runs on."""

    address: str | None = dataclasses.field(default=None, metadata=cli(
        "--address", help="Ray cluster to join ('auto': the local node's cluster); default: start a local one"))


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt()


@serve.ingress()
class EngineReplica:
    """One Ray Serve replica: an engine process and the HTTP API in front of it."""

    async def __init__(self, engine_args: list[str], *, model_name: str | None = None,
                       socket_dir: str | None = None, ready_timeout_s: float = 600.0,
                       engine_command: list[str] | None = None, limits: GatewayLimits | None = None,
                       engine_drain_s: float = ENGINE_DRAIN_S, store: StoreOptions | None = None,
                       batch: BatchOptions | None = None):
        self.limits = limits or GatewayLimits()
        self.store, self.batch = store, batch
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
        return create_app(self.link, self.limits, own_link=False, store=self.store, batch=self.batch)

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


def engine_arguments(config: AppConfig, device: str | None) -> list[str]:
    args = ["--model", str(config.model), "--slots", str(config.slots), "--decode-workers", str(config.decode_workers)]
    if config.lora_dir:
        args += ["--lora-dir", str(config.lora_dir)]
    if device:
        args += ["--device", device]
    return args + list(config.engine_extra)


def build_app(config: AppConfig | None = None, limits: GatewayLimits | None = None, *,
              store: StoreOptions | None = None, batch: BatchOptions | None = None, **fields):
    """The Serve application: `config.replicas` EngineReplicas (`fields` replace
    `config`'s), each enforcing `limits` in its gateway and serving batch jobs from
    `store`'s state dir under `batch`'s bounds. `gpus_per_replica` None: one GPU each if
    the cluster has GPUs, else none (engines then run on CPU)."""
    import ray

    config = dataclasses.replace(config or AppConfig(), **fields)
    gpus_per_replica = config.gpus_per_replica
    if gpus_per_replica is None:
        gpus_per_replica = 1.0 if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= 1 else 0.0
    # with a GPU, say so; without, let the engine choose (Ray hides the GPUs of a replica
    # that asked for none, so it runs on the CPU)
    device = "cuda" if gpus_per_replica else None
    actor_options = {"num_cpus": config.cpus_per_replica}
    if gpus_per_replica:
        actor_options["num_gpus"] = gpus_per_replica
    deployment = serve.deployment(
        EngineReplica, name="diffslot", num_replicas=config.replicas, ray_actor_options=actor_options,
        max_ongoing_requests=config.max_ongoing_requests,
        health_check_period_s=config.health_check_period_s, health_check_timeout_s=config.health_check_timeout_s,
        # past this Ray kills the replica, and PDEATHSIG stops its engine at once
        graceful_shutdown_timeout_s=config.engine_drain_s + 15.0)
    return deployment.bind(engine_arguments(config, device), model_name=config.model_name,
                           socket_dir=config.socket_dir, engine_command=config.engine_command,
                           limits=limits or GatewayLimits(), engine_drain_s=config.engine_drain_s,
                           store=store or StoreOptions(), batch=batch or BatchOptions())


def app_builder(args: dict):
    """For `serve run frontend.ray_app:app_builder replicas=2 model=shapes slots=8`: the
    fields of the command line's flags, by name. API keys come from DIFFSLOT_API_KEYS and
    priority classes from DIFFSLOT_KEY_CLASSES, not arguments (which show in process lists)."""
    limits = {name: value for name, value in args.items() if name in REPLICA_LIMITS}
    return build_app(config_from_mapping(AppConfig, args),
                     config_from_mapping(GatewayLimits, limits, api_keys=list(keys_from()),
                                         key_classes=key_class_specs()),
                     store=config_from_mapping(StoreOptions, args),
                     batch=config_from_mapping(BatchOptions, args, webhook_url_prefixes=[]))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m frontend.ray_app",
                                 description="the diffslot images API over Ray Serve replicas, one engine each")
    add_config_arguments(ap, AppConfig)
    add_config_arguments(ap, ServerOptions, only={"host", "port"})
    add_config_arguments(ap, DriverOptions)
    add_config_arguments(ap.add_argument_group("gateway limits, per replica"), GatewayLimits, only=REPLICA_LIMITS)
    add_config_arguments(ap.add_argument_group("state and outputs, shared by the replicas"), StoreOptions)
    add_config_arguments(ap.add_argument_group("batch jobs and webhooks"), BatchOptions)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_args(AppConfig, args)
    if config.lora_dir and not pathlib.Path(config.lora_dir).is_dir():  # before a cluster starts for nothing
        print(f"error: --lora-dir {config.lora_dir}: no such folder", file=sys.stderr)
        return 2
    server = config_from_args(ServerOptions, args)
    cluster = config_from_args(DriverOptions, args)
    limits = config_from_args(GatewayLimits, args, api_keys=list(keys_from(args.api_keys)),
                              key_classes=key_class_specs(args.key_classes))
    store, batch = config_from_args(StoreOptions, args), config_from_args(BatchOptions, args)

    import ray

    # the deployment class must be pickled by reference (as frontend.ray_app.EngineReplica), not
    # by value from __main__, which would drag this module's globals along
    from frontend.ray_app import build_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    ray.init(address=cluster.address)
    try:
        serve.start(http_options={"host": server.host, "port": server.port})
        serve.run(build_app(config, limits, store=store, batch=batch), name="diffslot", route_prefix="/")
        print(f"diffslot images API on http://{server.host}:{server.port}/v1 ({config.replicas} replicas); "
              "Ctrl-C stops it", flush=True)
        signal.signal(signal.SIGTERM, _raise_interrupt)
        while True:
            signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        try:
            serve.delete("diffslot")
            if cluster.address is None:
                serve.shutdown()
        finally:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
