"""`python -m frontend generate ...`, `python -m frontend stats` and `python -m frontend http ...`.

    python -m frontend generate --prompt "a red circle" --steps 20 --sampler dpmpp_2m \\
        --guidance 3 --seed 7 -o out.png [--address ADDR]
    python -m frontend generate --prompt "a blue circle" --image in.png [--mask m.png] --strength 0.6 \\
        [--lora NAME=SCALE ...] [--true-cfg X] -o out.png
    python -m frontend generate --prompt "a red circle" --control edges=edges.png:0.8 [--guess-mode] -o out.png

Shows a progress bar; Ctrl-C cancels the request on the engine.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import secrets
import signal
import sys

from engine.flags import add_config_arguments, cli, config_from_args, flag
from engine.protocol import OUTPUT_KINDS, SAMPLERS, Control, GenerateParams, frame_field_descriptions, parse_step_cache

# GenerateParams is the protocol's, which knows nothing of command lines: its flags are named here
PARAM_FLAGS = {
    "prompt": flag("--prompt", help='e.g. "a red circle"'),
    "negative_prompt": flag("--negative-prompt",
                            help="conditions the unconditional branch of guidance (default: the empty prompt)"),
    "steps": flag("--steps", help="denoising steps"),
    "sampler": flag("--sampler", help=f"one of {', '.join(SAMPLERS)}"),
    "guidance": flag("--guidance", help="the pipeline's guidance_scale"),
    "seed": flag("--seed", help="the request's random seed (default: a fresh random one, printed)"),
    "output": flag("--output-kind", dest="output_kind", choices=OUTPUT_KINDS,
                   help="png; uint8 and latent are saved as .npy"),
    "height": flag("--height", help="default: the model's native size, or the --image's"),
    "width": flag("--width", help="default: the model's native size, or the --image's"),
    "true_cfg": flag("--true-cfg", help="FLUX: the pipeline's true_cfg_scale"),
    "strength": flag("--strength", help="with --image: how far from it to start, (0, 1] (default: the pipeline's)"),
    "cache": flag("--cache", metavar="KIND[:THRESHOLD]", parse=parse_step_cache,
                  help="a step cache for this request: first_block, mag, taylorseer, taylorseer:lite, or off "
                       "(default: the server's)"),
    "guess_mode": flag("--guess-mode", help="with --control: SD/SDXL ControlNet guess mode"),
    "ip_scale": flag("--ip-scale", help="with --ip-image: the IP-Adapter's scale"),
}
# the empty negative prompt unless told otherwise, on every pipeline (SDXL zeroes an absent one instead)
PARAM_DEFAULTS = {"negative_prompt": "", "seed": None}


@dataclasses.dataclass
class GenerateOptions:
    """`generate`'s flags beside the request's parameters: its input files, adapters, output file."""

    out: str = dataclasses.field(metadata=cli("-o", "--out", help="file to write"))
    lora: list[str] = dataclasses.field(default_factory=list, metadata=cli(
        "--lora", metavar="NAME=SCALE",
        help="a LoRA adapter of the engine's --lora-dir at a scale (repeat for several)"))
    control: list[str] = dataclasses.field(default_factory=list, metadata=cli(
        "--control", metavar="NAME=PATH[:SCALE]",
        help="a ControlNet the engine serves (--controlnet) with the control image in PATH, at a scale (default 1; "
             "repeat for several)"))


@dataclasses.dataclass
class EngineOptions:
    """How the client reaches the engine."""

    address: str | None = dataclasses.field(default=None, metadata=cli(
        "--address", help="engine address (default: the local engine)"))
    timeout_s: float = dataclasses.field(default=30.0, metadata=cli(
        "--timeout", dest="timeout", help="seconds to wait for the engine to answer"))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m frontend", description="diffslot client")
    sub = ap.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate one image")
    add_config_arguments(gen, GenerateParams, specs=PARAM_FLAGS, defaults=PARAM_DEFAULTS)
    add_config_arguments(gen, GenerateOptions)
    for field, description in frame_field_descriptions().items():  # every bytes field of GenerateParams, from a file
        gen.add_argument(f"--{field.replace('_', '-')}", dest=f"file_{field}", metavar="FILE", default=None,
                         help=f"{description} (a file)")
    add_config_arguments(gen, EngineOptions)
    stats = sub.add_parser("stats", help="print the engine's counters as JSON")
    add_config_arguments(stats, EngineOptions, only={"address"})
    from frontend.http.server import add_arguments as http_arguments  # argparse only: no server imports yet

    http_arguments(sub.add_parser("http", help="serve the OpenAI-compatible images API (uvicorn)"))
    return ap


def generate(args: argparse.Namespace) -> int:
    import numpy as np
    from tqdm import tqdm

    from frontend import Canceled, Client, Completed, EngineDeadError, Rejected

    options = config_from_args(GenerateOptions, args)
    engine = config_from_args(EngineOptions, args)
    try:
        inputs = _inputs(options, args)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.seed is None:  # as the HTTP API: a fresh seed, printed so the image can be made again
        args.seed = secrets.randbelow(2**31)
    params = config_from_args(GenerateParams, args, specs=PARAM_FLAGS, **inputs)
    try:
        client = Client(engine.address, connect_timeout=engine.timeout_s)
        client.connect()
    except (ConnectionError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    interrupted = False
    try:
        handle = client.submit(params)
        for signum in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C (even if inherited as ignored), kill: cancel
            signal.signal(signum, signal.default_int_handler)
        try:
            with tqdm(total=params.steps, unit="step", desc=params.prompt[:30], leave=False, disable=None) as bar:
                for progress in handle.progress():
                    bar.update(progress.step - bar.n)
            result = handle.result()
        except KeyboardInterrupt:
            interrupted = True
            handle.cancel()
            print("canceling...", file=sys.stderr)
            result = handle.result(timeout=10)
    except EngineDeadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except TimeoutError:
        print("error: the engine did not confirm the cancel", file=sys.stderr)
        return 1
    finally:
        client.close()
    if isinstance(result, Completed):
        out = pathlib.Path(options.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        if result.output_kind == "png":
            out.write_bytes(result.output)
        else:
            np.save(out, result.output)
        t = result.timings
        image_encode = f", image encode {t.image_encode_s:.3f}" if t.image_encode_s else ""
        print(f"{out}: seed {params.seed}, {t.total_s:.3f}s (queue {t.queue_s:.3f}{image_encode}, denoise {t.denoise_s:.3f}, "
              f"decode wait {t.decode_wait_s:.3f}, decode {t.decode_s:.3f}; {t.evals} evals)")
        return 0
    if isinstance(result, Canceled):
        print(f"canceled after {result.timings.evals} evals", file=sys.stderr)
        return 130 if interrupted else 1
    if isinstance(result, Rejected):
        where = f" (field {result.field})" if result.field else ""
        print(f"rejected{where}: {result.reason}", file=sys.stderr)
        return 2
    print(f"failed: {result.error}", file=sys.stderr)
    return 1


def _inputs(options: GenerateOptions, args: argparse.Namespace) -> dict:
    """The request's byte inputs and adapters, from the files and NAME=SCALE pairs the
    flags give (only those given; the engine names a field it cannot take)."""
    inputs = {field: pathlib.Path(getattr(args, f"file_{field}")).read_bytes()
              for field in frame_field_descriptions() if getattr(args, f"file_{field}") is not None}
    loras = {}
    for item in options.lora:
        name, sep, scale = item.rpartition("=")
        if not sep or not name:
            raise ValueError(f"--lora {item!r}: expected NAME=SCALE")
        try:
            loras[name] = float(scale)
        except ValueError:
            raise ValueError(f"--lora {item!r}: the scale is not a number") from None
    if loras:
        inputs["loras"] = loras
    controls = [parse_control(item) for item in options.control]
    if controls:
        inputs["controls"] = tuple(controls)
    return inputs


def parse_control(item: str) -> Control:
    """`NAME=PATH[:SCALE]` → a `Control` with the image read from PATH; ValueError saying
    what is wrong. A last `:` part that is not a number belongs to the path."""
    name, sep, rest = item.partition("=")
    if not sep or not name or not rest:
        raise ValueError(f"--control {item!r}: expected NAME=PATH[:SCALE]")
    path, scale = rest, 1.0
    head, colon, tail = rest.rpartition(":")
    if colon and head:
        try:
            path, scale = head, float(tail)
        except ValueError:
            pass
    return Control(name=name, image=pathlib.Path(path).read_bytes(), scale=scale)


def stats(args: argparse.Namespace) -> int:
    from frontend import Client

    try:
        with Client(config_from_args(EngineOptions, args).address, connect_timeout=10) as client:
            print(json.dumps(client.stats(), indent=1, sort_keys=True))
    except (ConnectionError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "http":
        from frontend.http.server import serve

        return serve(args)
    return generate(args) if args.command == "generate" else stats(args)


if __name__ == "__main__":
    sys.exit(main())
