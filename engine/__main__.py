"""`python -m engine {serve,health,demo,queue-instrument}` (also the `diffslot` console script).

Every flag is a field of a configuration dataclass (engine.flags): `CoreConfig`,
`DecodeConfig` and `ProcConfig` for the engine itself, and the dataclasses below for
the model, the adapters and each command's own options; so each default is the field's
own. `queue-instrument` parses its own flags (engine.instrument.cli).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import pathlib
import sys

from engine.core.config import ADMISSIONS, LAYOUTS, POLICIES, CoreConfig
from engine.decode.stage import DecodeConfig
from engine.flags import add_config_arguments, cli, config_from_args, flag
from engine.protocol import parse_step_cache
from engine.serve.options import add_proc_arguments, proc_config_from_args

# CoreConfig lives with the core, which knows nothing of command lines: its flags are named here
CORE_FLAGS = {
    "slots": flag("--slots", metavar="N", help="trajectories denoised together, per latent shape (default 16; "
                                                "--profile-slots: from the denoiser's rows/s curve on a CPU)"),
    "max_input_bytes": flag("--max-input-bytes", metavar="N", help="the largest image or mask a request may send"),
    "layout": flag("--layout", choices=LAYOUTS, help="how a batch is assembled from the active slots"),
    "admission": flag("--admission", choices=ADMISSIONS,
                      help="continuous: free slots are filled at every step; static: a new batch when the last "
                           "one finished"),
    "max_queue": flag("--max-queue", metavar="N", help="requests waiting for a slot before Rejected"),
    "policy": flag("--policy", choices=POLICIES,
                   help="admission order: fifo, or srpt (least remaining work first, aged so none starves)"),
    "srpt_aging": flag("--srpt-aging", metavar="X",
                       help="srpt: the work admitted while a request waits is at most X × (the work queued ahead "
                            "of it + its own); then it goes first"),
    "group_aging": flag("--group-aging", metavar="X",
                        help="the group whose next request finishes soonest runs next, but one that waited X × "
                             "(other runnable groups) batches goes first; 0: groups take turns"),
    "priority_aging": flag("--priority-aging", metavar="X",
                           help="a request of a lower priority goes first once the work admitted while it waits "
                                "exceeds X × (the work queued ahead of it + its own)"),
    "preemption": flag("--no-preemption", negate=True,
                       help="never park running requests of a lower priority for a higher one"),
    "preempt_min_steps": flag("--preempt-min-steps", metavar="N",
                              help="steps a request runs after its (re)admission before it may be parked"),
    "max_preemptions": flag("--max-preemptions", metavar="N", help="times one request may be parked"),
    "parked_budget_bytes": flag("--parked-budget-bytes", metavar="N",
                                help="host bytes for parked requests' slot state (default: the trajectory budget)"),
    "cache": flag("--cache", metavar="KIND[:THRESHOLD]", parse=parse_step_cache,
                  help="the step cache of requests that name none: first_block, mag, taylorseer or taylorseer:lite "
                       "(diffusers' defaults), decided per request; a request's cache=off turns it off"),
    "cuda_graphs": flag("--no-cuda-graphs", negate=True,
                        help="with --layout bucketed on CUDA, launch the denoiser eagerly instead of replaying one "
                             "CUDA graph per bucket"),
}


@dataclasses.dataclass
class ModelOptions:
    """Which model the engine serves, where, and in which dtype."""

    model: str = dataclasses.field(default="shapes", metadata=cli(
        "--model", metavar="FOLDER|HUB_ID|FILE",
        help="'shapes' or 'shapes-dit' (embedded), a diffusers pipeline folder, a "
             "Hugging Face hub id (org/name: from the local cache, downloaded when absent and online) or a "
             "single-file checkpoint (.safetensors/.ckpt)"))
    revision: str | None = dataclasses.field(default=None, metadata=cli(
        "--revision", help="a hub id's branch, tag or commit (default: main)"))
    variant: str | None = dataclasses.field(default=None, metadata=cli(
        "--variant", help="the weights variant to load, e.g. fp16 (default: the default weights, or the one "
                          "variant the folder holds)"))
    config: str | None = dataclasses.field(default=None, metadata=cli(
        "--config", metavar="FOLDER|HUB_ID",
        help="a single file's pipeline configs, tokenizers and scheduler: a pipeline folder or hub id of its "
             "architecture (default: the hub repo diffusers names for it)"))
    device: str | None = dataclasses.field(default=None, metadata=cli(
        "--device", choices=("cpu", "cuda"), help="default: cuda if present"))
    dtype: str = dataclasses.field(default="float32", metadata=cli(
        "--dtype", choices=("float32", "float16", "bfloat16"),
        help="the weights' dtype (denoiser, encoders, in-process VAE; float16 or bfloat16 on a GPU); latents and "
             "solver state stay float32"))


@dataclasses.dataclass
class AdapterOptions:
    """The LoRA adapters the engine serves (engine.lora.AdapterPool)."""

    lora_dir: str | None = dataclasses.field(default=None, metadata=cli(
        "--lora-dir", metavar="DIR",
        help="serve every diffusers-format LoRA in DIR (NAME.safetensors, or NAME/ holding "
             "pytorch_lora_weights.safetensors) as adapter NAME; new files are found without a restart"))
    max_loras_per_request: int = dataclasses.field(default=4, metadata=cli(
        "--max-loras-per-request", metavar="N", help="adapters one request may name"))
    lora_budget_bytes: int = dataclasses.field(default=256 << 20, metadata=cli(
        "--lora-budget-bytes", metavar="N",
        help="bytes the adapter pool holds (resident adapters' factors, the padded stacks made from them, its "
             "tables); least recently used unreferenced adapters are evicted beyond it"))


@dataclasses.dataclass
class ControlNetOptions:
    """The ControlNets (engine.models.controlnet) and the IP-Adapter (engine.models.ip_adapter)
    the engine serves beside the model."""

    controlnets: list[str] = dataclasses.field(default_factory=list, metadata=cli(
        "--controlnet", metavar="NAME=PATH",
        help="serve the diffusers ControlNet folder PATH (ControlNetModel; FluxControlNetModel for FLUX, "
             "SD3ControlNetModel for SD3) as ControlNet NAME (repeatable); requests name it in `controls`"))
    ip_adapter: str | None = dataclasses.field(default=None, metadata=cli(
        "--ip-adapter", metavar="PATH",
        help="serve the IP-Adapter in PATH (its weights file and image_encoder/); requests give an ip_image"))


def parse_controlnets(specs: list[str]) -> dict[str, str]:
    """NAME=PATH flags → {NAME: PATH}; ValueError saying which one is wrong."""
    found = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--controlnet {spec!r}: NAME=PATH")
        if name in found:
            raise ValueError(f"--controlnet {name}: given twice")
        found[name] = path
    return found


@dataclasses.dataclass
class ServeOptions:
    """`serve`'s own flags, beside the engine's and the engine process's."""

    address: str | None = dataclasses.field(default=None, metadata=cli(
        "--address", help="ipc://PATH or tcp://HOST:PORT (default: ipc socket in the user's runtime dir)"))
    log_level: str = dataclasses.field(default="INFO", metadata=cli("--log-level", help="the engine's log level"))
    # tests only: engine.testing.faults (raise=PROMPT, nan=PROMPT, oom=ROWS)
    inject_faults: str | None = dataclasses.field(default=None, metadata=cli(
        "--inject-faults", metavar="SPEC", help=argparse.SUPPRESS))
    profile_slots: bool = dataclasses.field(default=False, metadata=cli(
        "--profile-slots", help="without --slots on a CPU: time the denoiser at 1 to 64 rows a call (up to 10 s at "
                                "start) and take the slots at the knee of its rows/s curve"))
    core: str | None = dataclasses.field(default=None, metadata=cli(
        "--core", metavar="MODULE:FACTORY",
        help="serve another core behind the same process and IO path (benchmark baselines): FACTORY(model, "
             "CoreConfig) returns an object with the CoreInterface calls"))


@dataclasses.dataclass
class HealthOptions:
    """`health`'s flags: what a client needs to reach the engine, and how long to wait."""

    address: str | None = dataclasses.field(default=None, metadata=cli(
        "--address", help="default: $DIFFSLOT_ADDRESS or the one local engine"))
    timeout_s: float = dataclasses.field(default=5.0, metadata=cli(
        "--timeout", dest="timeout", help="seconds for the handshake and for the answer, each"))
    ready: bool = dataclasses.field(default=False, metadata=cli(
        "--ready", help="also fail (exit 1) while the engine drains"))
    auth_token_file: str | None = dataclasses.field(default=None, metadata=cli(
        "--auth-token-file", metavar="PATH", help="default: $DIFFSLOT_TOKEN"))
    curve_server_key: str | None = dataclasses.field(default=None, metadata=cli(
        "--curve-server-key", metavar="FILE",
        help="the engine's public CURVE certificate (default: $DIFFSLOT_CURVE_SERVER_KEY)"))
    curve_client_key: str | None = dataclasses.field(default=None, metadata=cli(
        "--curve-client-key", metavar="FILE",
        help="this client's secret CURVE certificate, where the engine admits only known keys "
             "(default: $DIFFSLOT_CURVE_CLIENT_KEY)"))


@dataclasses.dataclass
class DemoOptions:
    """`demo`'s own flag, beside the engine's."""

    out: str = dataclasses.field(default="out/demo_grid.png", metadata=cli("--out", help="where to write the grid"))


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def add_engine_arguments(ap: argparse.ArgumentParser) -> None:
    """The engine's flags, shared by `serve` and `demo`."""
    add_config_arguments(ap, ModelOptions)
    add_config_arguments(ap.add_argument_group("core"), CoreConfig, specs=CORE_FLAGS, defaults={"slots": None})
    add_config_arguments(ap.add_argument_group("decode"), DecodeConfig)
    add_config_arguments(ap.add_argument_group("adapters"), AdapterOptions)
    add_config_arguments(ap.add_argument_group("controlnets"), ControlNetOptions)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m engine", description="diffslot serving engine")
    sub = ap.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the engine process")
    add_engine_arguments(serve)
    add_config_arguments(serve, ServeOptions)
    add_proc_arguments(serve)
    health = sub.add_parser("health", help="liveness/readiness probe, answered while a step runs")
    add_config_arguments(health, HealthOptions)
    demo = sub.add_parser("demo", help="start an engine, run a mixed batch, write a PNG grid")
    add_engine_arguments(demo)
    add_config_arguments(demo, DemoOptions)
    sub.add_parser("queue-instrument", help="the fluid queue model", add_help=False)
    return ap


def serve(args: argparse.Namespace) -> int:
    from engine.serve import transport

    options = config_from_args(ServeOptions, args)
    model_options = config_from_args(ModelOptions, args)
    adapter_options = config_from_args(AdapterOptions, args)
    try:  # fail before the slow imports and model load
        address = transport.normalize_address(options.address or transport.default_address())
        control_options = config_from_args(ControlNetOptions, args)
        controlnets = parse_controlnets(control_options.controlnets)
        transport.check_bind_address(address, args.allow_remote_bind)
        if adapter_options.lora_dir and not pathlib.Path(adapter_options.lora_dir).is_dir():
            raise ValueError(f"--lora-dir {adapter_options.lora_dir}: no such folder")
        proc_config = proc_config_from_args(args, address=address, model_name=str(model_options.model))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    import torch

    from engine.core import EngineCore
    from engine.serve.proc import configure_logging, run_engine

    configure_logging(getattr(logging, options.log_level.upper(), logging.INFO))
    log = logging.getLogger("diffslot.engine")
    for stale in transport.sweep_stale_sockets():
        log.info("removed stale socket %s", stale)
    from engine.decode.factory import make_decode_stage
    from engine.models.loading import load_model

    device = model_options.device or default_device()
    if device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    log.info("loading model %s on %s (%s)", model_options.model, device, model_options.dtype)
    from engine.models import ModelLoadError, ModelNotFound

    try:
        model = load_model(model_options.model, device, dtype=model_options.dtype, revision=model_options.revision,
                           variant=model_options.variant, config=model_options.config)
    except (ModelNotFound, ModelLoadError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if controlnets:
        from engine.models.controlnet import attach_controlnets

        try:  # checked against the served UNet: a ControlNet that does not fit stops the start
            attach_controlnets(model, controlnets)
        except (ValueError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        log.info("ControlNets: %s", ", ".join(controlnets))
    if control_options.ip_adapter:
        from engine.models.ip_adapter import attach_ip_adapter

        try:
            attach_ip_adapter(model, control_options.ip_adapter)
        except (ValueError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        log.info("IP-Adapter: %s", control_options.ip_adapter)
    slots = args.slots
    if slots is None:  # the config's default, or on a CPU when asked the knee of the denoiser's own curve
        slots = CoreConfig.slots
        if options.profile_slots and device == "cpu":
            from engine.core.profile import profile_slots

            slots = profile_slots(model).slots
    config = config_from_args(CoreConfig, args, specs=CORE_FLAGS, device=device, slots=slots)
    decode_config = config_from_args(DecodeConfig, args)
    if options.inject_faults:
        from engine.testing.faults import FaultyModel, parse_spec

        model = FaultyModel(model, **parse_spec(options.inject_faults))
    adapters = None
    if adapter_options.lora_dir:
        from engine.lora import AdapterPool

        adapters = AdapterPool(model, adapter_options.lora_dir, budget_bytes=adapter_options.lora_budget_bytes,
                               max_per_request=adapter_options.max_loras_per_request)
        log.info("adapters from %s: %s", adapter_options.lora_dir, ", ".join(adapters.names()) or "none yet")
    if options.core:
        core = _core_factory(options.core)(model, config)
    else:
        core = EngineCore(model, config, adapters=adapters)
    return run_engine(core, proc_config,  # the arena holds every decode that admission reserves
                      lambda on_ready: make_decode_stage(model, decode_config, on_ready,
                                                         buffers=core.config.decode_buffers))


def _core_factory(spec: str):
    import importlib

    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name or "make_core")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "queue-instrument":  # it parses its own flags
        from engine.instrument.cli import main as qi

        return qi(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        try:
            return serve(args)
        except KeyboardInterrupt:  # Ctrl-C while the model loads: nothing to drain yet
            return 130
    if args.command == "health":
        import os

        from frontend.health import main as health

        options = config_from_args(HealthOptions, args)
        return health(options.address, options.timeout_s, options.ready, options.auth_token_file,
                      options.curve_server_key or os.environ.get("DIFFSLOT_CURVE_SERVER_KEY"),
                      options.curve_client_key or os.environ.get("DIFFSLOT_CURVE_CLIENT_KEY"))
    if args.command == "demo":
        from engine.demo import main as demo

        return demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
