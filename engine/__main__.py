"""`python -m engine {serve,demo,queue-instrument}` (also the `diffslot` console script)."""
from __future__ import annotations

import argparse
import logging
import sys

LAYOUTS = ("compact", "padded", "bucketed")
ADMISSIONS = ("continuous", "static")


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def add_engine_arguments(ap: argparse.ArgumentParser) -> None:
    """The engine's flags, shared by `serve` and `demo`."""
    ap.add_argument("--model", default="shapes", help="'shapes' (embedded) or a diffusers model folder")
    ap.add_argument("--slots", type=int, default=16, help="trajectories denoised together")
    ap.add_argument("--layout", choices=LAYOUTS, default="compact")
    ap.add_argument("--admission", choices=ADMISSIONS, default="continuous")
    ap.add_argument("--decode-workers", type=int, default=2, help="decode worker processes")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if present")
    ap.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before Rejected")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m engine", description="diffslot serving engine")
    sub = ap.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the engine process")
    add_engine_arguments(serve)
    serve.add_argument("--address", default=None,
                       help="ipc://PATH or tcp://HOST:PORT (default: ipc socket in the user's runtime dir)")
    serve.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on 127.0.0.1")
    serve.add_argument("--allow-remote-bind", action="store_true",
                       help="allow a non-loopback tcp address (the protocol has no authentication)")
    serve.add_argument("--log-level", default="INFO")
    demo = sub.add_parser("demo", help="start an engine, run a mixed batch, write a PNG grid")
    add_engine_arguments(demo)
    demo.add_argument("--out", default="out/demo_grid.png", help="where to write the grid")
    sub.add_parser("queue-instrument", help="the fluid queue model (R12)", add_help=False)
    return ap


def serve(args: argparse.Namespace) -> int:
    from engine import transport

    address = args.address or transport.default_address()
    try:  # fail before the slow imports and model load
        transport.check_bind_address(address, args.allow_remote_bind)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    import torch

    from engine.core import CoreConfig, EngineCore
    from engine.proc import ProcConfig, configure_logging, run_engine

    configure_logging(getattr(logging, args.log_level.upper(), logging.INFO))
    log = logging.getLogger("diffslot.engine")
    for stale in transport.sweep_stale_sockets():
        log.info("removed stale socket %s", stale)
    from engine.decode_stage import make_decode_stage
    from engine.model import load_model

    device = args.device or default_device()
    if device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    log.info("loading model %s on %s", args.model, device)
    model = load_model(args.model, device)
    config = CoreConfig(slots=args.slots, layout=args.layout, admission=args.admission,
                        max_queue=args.max_queue, device=device)
    core = EngineCore(model, config)
    proc_config = ProcConfig(address=address, allow_remote_bind=args.allow_remote_bind,
                             metrics_port=args.metrics_port, model_name=str(args.model))
    return run_engine(core, model, proc_config,  # the arena holds every decode that admission reserves
                      lambda on_ready: make_decode_stage(model, args.decode_workers, on_ready,
                                                         buffers=core.config.decode_buffers))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "queue-instrument":  # it parses its own flags
        from engine.queue_instrument import main as qi

        return qi(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "demo":
        from engine.demo import main as demo

        return demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
