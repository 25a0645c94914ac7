"""`python -m engine {serve,health,demo,queue-instrument}` (also the `diffslot` console script).

The flags of `serve` and `demo` are made from the configuration dataclasses' fields
(`CoreConfig`, `DecodeConfig`, `ProcConfig`; engine.serve.options), so each default is
the field's own; only the model's loading options and the address are written here.
"""
from __future__ import annotations

import argparse
import logging
import sys

from engine.core.config import ADMISSIONS, LAYOUTS, POLICIES, CoreConfig
from engine.decode.stage import DecodeConfig
from engine.serve.options import add_config_arguments, add_proc_arguments, config_from_args, flag, \
    proc_config_from_args

# CoreConfig lives with the core: its flags' names and help are given here
CORE_FLAGS = {
    "slots": flag("--slots", metavar="N", help="trajectories denoised together, per latent shape (default: on a "
                                                "CPU from the denoiser's rows/s curve, profiled at start; 16 on CUDA)"),
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
    "cuda_graphs": flag("--no-cuda-graphs", negate=True,
                        help="with --layout bucketed on CUDA, launch the denoiser eagerly instead of replaying one "
                             "CUDA graph per bucket"),
}


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def add_engine_arguments(ap: argparse.ArgumentParser) -> None:
    """The engine's flags, shared by `serve` and `demo`."""
    ap.add_argument("--model", default="shapes", help="'shapes' (embedded) or a diffusers model folder")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if present")
    ap.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32",
                    help="the weights' dtype (denoiser, encoders, in-process VAE); latents and solver state stay "
                         "float32 (default %(default)s; float16 or bfloat16 on a GPU)")
    add_config_arguments(ap.add_argument_group("core"), CoreConfig, specs=CORE_FLAGS, defaults={"slots": None})
    add_config_arguments(ap.add_argument_group("decode"), DecodeConfig)
    adapters = ap.add_argument_group("adapters")
    adapters.add_argument("--lora-dir", default=None, metavar="DIR",
                          help="serve every diffusers-format LoRA in DIR (NAME.safetensors, or NAME/ holding "
                               "pytorch_lora_weights.safetensors) as adapter NAME; new files are found without a "
                               "restart")
    adapters.add_argument("--max-loras-per-request", type=int, default=4, metavar="N",
                          help="adapters one request may name (default %(default)s)")
    adapters.add_argument("--lora-budget-bytes", type=int, default=256 << 20, metavar="N",
                          help="device bytes of resident adapters; least recently used unreferenced ones are "
                               "evicted beyond it (default %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m engine", description="diffslot serving engine")
    sub = ap.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the engine process")
    add_engine_arguments(serve)
    serve.add_argument("--address", default=None,
                       help="ipc://PATH or tcp://HOST:PORT (default: ipc socket in the user's runtime dir)")
    add_proc_arguments(serve)
    serve.add_argument("--log-level", default="INFO")
    serve.add_argument("--inject-faults", default=None, metavar="SPEC", help=argparse.SUPPRESS)  # tests only:
    # engine.testing.faults — raise=PROMPT, nan=PROMPT, oom=ROWS
    serve.add_argument("--core", default=None, metavar="MODULE:FACTORY",
                       help="serve another core behind the same process and IO path (benchmark baselines): "
                            "FACTORY(model, CoreConfig) returns an object with the CoreInterface calls")
    health = sub.add_parser("health", help="liveness/readiness probe, answered while a step runs")
    health.add_argument("--address", default=None, help="default: $DIFFSLOT_ADDRESS or the one local engine")
    health.add_argument("--timeout", type=float, default=5.0,
                        help="seconds for the handshake and for the answer, each (default %(default)s)")
    health.add_argument("--ready", action="store_true", help="also fail (exit 1) while the engine drains")
    health.add_argument("--auth-token-file", default=None, metavar="PATH", help="default: $DIFFSLOT_TOKEN")
    health.add_argument("--curve-server-key", default=None, metavar="FILE",
                        help="the engine's public CURVE certificate (default: $DIFFSLOT_CURVE_SERVER_KEY)")
    health.add_argument("--curve-client-key", default=None, metavar="FILE",
                        help="this client's secret CURVE certificate, where the engine admits only known keys "
                             "(default: $DIFFSLOT_CURVE_CLIENT_KEY)")
    demo = sub.add_parser("demo", help="start an engine, run a mixed batch, write a PNG grid")
    add_engine_arguments(demo)
    demo.add_argument("--out", default="out/demo_grid.png", help="where to write the grid")
    sub.add_parser("queue-instrument", help="the fluid queue model", add_help=False)
    return ap


def serve(args: argparse.Namespace) -> int:
    from engine.serve import transport

    address = args.address or transport.default_address()
    try:  # fail before the slow imports and model load
        transport.check_bind_address(address, args.allow_remote_bind)
        proc_config = proc_config_from_args(args, address=address, model_name=str(args.model))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    import torch

    from engine.core import EngineCore
    from engine.serve.proc import configure_logging, run_engine

    configure_logging(getattr(logging, args.log_level.upper(), logging.INFO))
    log = logging.getLogger("diffslot.engine")
    for stale in transport.sweep_stale_sockets():
        log.info("removed stale socket %s", stale)
    from engine.decode.factory import make_decode_stage
    from engine.models.loading import load_model

    device = args.device or default_device()
    if device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    log.info("loading model %s on %s (%s)", args.model, device, args.dtype)
    model = load_model(args.model, device, dtype=args.dtype)
    slots = args.slots
    if slots is None:  # from the denoiser's own curve on a CPU; on CUDA the config's default
        if device == "cpu":
            from engine.core.profile import profile_slots

            slots = profile_slots(model).slots
        else:
            slots = CoreConfig.slots
    config = config_from_args(CoreConfig, args, specs=CORE_FLAGS, device=device, slots=slots)
    decode_config = config_from_args(DecodeConfig, args)
    if args.inject_faults:
        from engine.testing.faults import FaultyModel, parse_spec

        model = FaultyModel(model, **parse_spec(args.inject_faults))
    adapters = None
    if args.lora_dir:
        from engine.lora import AdapterPool

        adapters = AdapterPool(model, args.lora_dir, budget_bytes=args.lora_budget_bytes,
                               max_per_request=args.max_loras_per_request)
        log.info("adapters from %s: %s", args.lora_dir, ", ".join(adapters.names()) or "none yet")
    if args.core:
        core = _core_factory(args.core)(model, config)
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
        return serve(args)
    if args.command == "health":
        import os

        from frontend.health import main as health

        return health(args.address, args.timeout, args.ready, args.auth_token_file,
                      args.curve_server_key or os.environ.get("DIFFSLOT_CURVE_SERVER_KEY"),
                      args.curve_client_key or os.environ.get("DIFFSLOT_CURVE_CLIENT_KEY"))
    if args.command == "demo":
        from engine.demo import main as demo

        return demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
