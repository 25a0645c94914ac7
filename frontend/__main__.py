"""`python -m frontend generate ...`, `python -m frontend stats` and `python -m frontend http ...`.

    python -m frontend generate --prompt "a red circle" --steps 20 --sampler dpmpp_2m \\
        --guidance 3 --seed 7 -o out.png [--address ADDR]
    python -m frontend generate --prompt "a blue circle" --image in.png [--mask m.png] --strength 0.6 \\
        [--lora NAME=SCALE ...] [--true-cfg X] -o out.png

Shows a progress bar; Ctrl-C cancels the request on the engine.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import signal
import sys

from engine.protocol import OUTPUT_KINDS, SAMPLERS


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m frontend", description="diffslot client")
    sub = ap.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate one image")
    gen.add_argument("--prompt", required=True, help='e.g. "a red circle"')
    gen.add_argument("--negative-prompt", default="", help="conditions the unconditional branch of guidance")
    gen.add_argument("--steps", type=int, default=20)
    gen.add_argument("--sampler", default="default", help=f"one of {', '.join(SAMPLERS)}")
    gen.add_argument("--guidance", type=float, default=3.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--height", type=int, default=None)
    gen.add_argument("--width", type=int, default=None)
    gen.add_argument("--image", default=None, metavar="FILE",
                     help="img2img: start from this PNG, JPEG or WebP image (its size, unless --height/--width)")
    gen.add_argument("--mask", default=None, metavar="FILE", help="inpainting: the image's size, white = repaint")
    gen.add_argument("--strength", type=float, default=None,
                     help="with --image: how far from it to start, (0, 1] (default: the pipeline's)")
    gen.add_argument("--lora", action="append", default=[], metavar="NAME=SCALE",
                     help="a LoRA adapter of the engine's --lora-dir at a scale (repeat for several)")
    gen.add_argument("--true-cfg", type=float, default=None, help="FLUX: the pipeline's true_cfg_scale")
    gen.add_argument("--output-kind", choices=OUTPUT_KINDS, default="png",
                     help="png; uint8 and latent are saved as .npy")
    gen.add_argument("-o", "--out", required=True, help="file to write")
    gen.add_argument("--address", default=None, help="engine address (default: the local engine)")
    gen.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the engine to answer")
    stats = sub.add_parser("stats", help="print the engine's counters as JSON")
    stats.add_argument("--address", default=None)
    from frontend.http.server import add_arguments as http_arguments  # argparse only: no server imports yet

    http_arguments(sub.add_parser("http", help="serve the OpenAI-compatible images API (uvicorn)"))
    return ap


def generate(args: argparse.Namespace) -> int:
    import numpy as np
    from tqdm import tqdm

    from frontend import Canceled, Client, Completed, EngineDeadError, GenerateParams, Rejected

    try:
        extras = _extras(args)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    params = GenerateParams(prompt=args.prompt, negative_prompt=args.negative_prompt, steps=args.steps,
                            sampler=args.sampler,
                            guidance=args.guidance, seed=args.seed, output=args.output_kind,
                            height=args.height, width=args.width, **extras)
    try:
        client = Client(args.address, connect_timeout=args.timeout)
        client.connect()
    except ConnectionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    interrupted = False
    try:
        handle = client.submit(params)
        for signum in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C (even if inherited as ignored), kill: cancel
            signal.signal(signum, signal.default_int_handler)
        try:
            with tqdm(total=args.steps, unit="step", desc=args.prompt[:30], leave=False, disable=None) as bar:
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
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        if result.output_kind == "png":
            out.write_bytes(result.output)
        else:
            np.save(out, result.output)
        t = result.timings
        image_encode = f", image encode {t.image_encode_s:.3f}" if t.image_encode_s else ""
        print(f"{out}: {t.total_s:.3f}s (queue {t.queue_s:.3f}{image_encode}, denoise {t.denoise_s:.3f}, "
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


def _extras(args: argparse.Namespace) -> dict:
    """The image inputs, adapters and true_cfg the flags give (only those given)."""
    extras = {}
    if args.image is not None:
        extras["image"] = pathlib.Path(args.image).read_bytes()
    elif args.mask is not None or args.strength is not None:
        raise ValueError("--mask and --strength need --image")
    if args.mask is not None:
        extras["mask"] = pathlib.Path(args.mask).read_bytes()
    if args.strength is not None:
        extras["strength"] = args.strength
    loras = {}
    for item in args.lora:
        name, sep, scale = item.rpartition("=")
        if not sep or not name:
            raise ValueError(f"--lora {item!r}: expected NAME=SCALE")
        try:
            loras[name] = float(scale)
        except ValueError:
            raise ValueError(f"--lora {item!r}: the scale is not a number") from None
    if loras:
        extras["loras"] = loras
    if args.true_cfg is not None:
        extras["true_cfg"] = args.true_cfg
    return extras


def stats(args: argparse.Namespace) -> int:
    from frontend import Client

    try:
        with Client(args.address, connect_timeout=10) as client:
            print(json.dumps(client.stats(), indent=1, sort_keys=True))
    except ConnectionError as exc:
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
