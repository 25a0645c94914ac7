"""`python -m engine demo`: the main job on the embedded model, end to end.

Starts an engine process (and through it the decode stage), submits a mixed set —
every prompt the embedded model knows, several step counts, five samplers, guidance 1
to 5, a negative prompt, one long request canceled midway, and on the embedded model an
img2img and an inpainting edit, a request through each LoRA adapter shipped with it
(beside the same request without) and two through its silhouette ControlNet (a shape
in a corner) — writes the images as one PNG grid (each input or control image beside
its output), prints one table row per request with its timings, stops the engine with
SIGTERM, and checks that no process or /dev/shm segment is left behind.
"""
from __future__ import annotations

import argparse
import io
import os
import pathlib
import shutil
import sys
import tempfile
import time

import numpy as np

from engine.models.shapes.draw import PROMPTS as SHAPES_PROMPTS
from engine.protocol import SEGMENT_PREFIX, Control
from engine.serve import transport
from frontend.launcher import launched_engine

#: the LoRA adapters trained for the embedded model (engine.models.shapes.train_lora)
SHAPES_LORAS = pathlib.Path(__file__).resolve().parent / "models" / "shapes" / "loras"
#: the silhouette ControlNet trained for it (engine.models.shapes.train_controlnet), served by the demo under this name
SHAPES_CONTROLNET = pathlib.Path(__file__).resolve().parent / "models" / "shapes" / "controlnet"
SILHOUETTE = "silhouette"
#: img2img and inpainting settings at which the embedded model does the edit: measured over
#: seeds 0-7 (tests/test_readme_snippets.py), 8 of 8 read as the prompt by the classifier
IMG2IMG = dict(strength=0.7, guidance=5.0, steps=20)
INPAINT = dict(strength=0.9, guidance=5.0, steps=20)
#: the silhouette ControlNet's settings, those bench/shapes_controlnet.py measures it at (the model's own DDIM
#: scheduler, 20 steps, guidance 3, the empty negative prompt, scale 1)
CONTROLNET = dict(steps=20, guidance=3.0, sampler="default", negative_prompt="")
CONTROLNET_SCALE = 1.0
#: (prompt, shape, centre y, centre x, size): small shapes in corners, where the plain prompt seldom draws them;
#: at CONTROLNET over seeds 0-7 all 16 read as their prompt, the drawn figure's IoU with the silhouette 0.69-0.94
SILHOUETTES = (("a red triangle", "triangle", 9.5, 9.5, 15), ("a blue circle", "circle", 23.0, 23.0, 13))

MIXED_SAMPLERS = ("default", "euler", "euler_ancestral", "ddim", "dpmpp_2m")  # the mix the demo runs (of engine.protocol.SAMPLERS)
STEPS = (8, 15, 25, 40)
GUIDANCE = (1.0, 3.0, 5.0)
LONG_STEPS = 200
COLUMNS = 5  # the grid's


def plan(prompts: list[str], adapters: list[str] = (), controlnets: list[str] = ()) -> list[dict]:
    requests = []
    for i, prompt in enumerate(prompts):
        requests.append(dict(prompt=prompt, steps=STEPS[i % len(STEPS)], sampler=MIXED_SAMPLERS[i % len(MIXED_SAMPLERS)],
                             guidance=GUIDANCE[i % len(GUIDANCE)], seed=i, output="png"))
    # the first prompt once more with a negative prompt naming another colour
    requests.append(dict(prompt=prompts[0], negative_prompt=prompts[-1], steps=20, sampler="dpmpp_2m",
                         guidance=3.0, seed=0, output="png"))
    requests.append(dict(prompt=prompts[0], steps=LONG_STEPS, sampler="dpmpp_2m", guidance=3.0, seed=99,
                         output="png", cancel_at=LONG_STEPS // 2))
    if "a blue circle" in prompts and "a green square" in prompts:  # the embedded model: edits too
        red_circle, _ = drawn("circle")
        red_square, square = drawn("square")
        requests.append(dict(prompt="a blue circle", image=_png(red_circle), sampler="default", seed=2, output="png",
                             edit="img2img of the input", input=red_circle, **IMG2IMG))
        requests.append(dict(prompt="a green square", image=_png(red_square), mask=_png(square), sampler="default",
                             seed=1, output="png", edit="inpainting the input's box",
                             input=outlined(red_square, square), **INPAINT))
    if SILHOUETTE in controlnets and all(prompt in prompts for prompt, *_ in SILHOUETTES):
        for seed, (prompt, shape, cy, cx, size) in enumerate(SILHOUETTES):
            control = silhouette(shape, cy, cx, size)
            requests.append(dict(prompt=prompt, seed=seed, output="png", **CONTROLNET,
                                 controls=(Control(SILHOUETTE, _png(control), scale=CONTROLNET_SCALE),),
                                 edit=f"ControlNet {SILHOUETTE!r} at {CONTROLNET_SCALE}", input=control))
    if adapters:  # one request without an adapter, then the same with each
        base = dict(prompt=prompts[min(6, len(prompts) - 1)], steps=20, sampler="dpmpp_2m", guidance=3.0, seed=5,
                    output="png")
        requests.append(dict(base, edit="no adapter"))
        requests += [dict(base, loras={name: 1.0}, edit=f"LoRA {name!r} at 1.0") for name in adapters]
    return requests


def drawn(shape: str) -> tuple[np.ndarray, np.ndarray]:
    """A red `shape` drawn as the shapes model's training images are, and a white mask of its box."""
    from engine.models.shapes.draw import SIZE, shape_mask

    image = np.full((SIZE, SIZE, 3), 128, np.uint8)
    inside = shape_mask(shape, 16, 16, 18)
    image[inside] = (230, 26, 26)
    ys, xs = np.nonzero(inside)
    mask = np.zeros_like(image)
    mask[ys.min() - 2:ys.max() + 3, xs.min() - 2:xs.max() + 3] = 255
    return image, mask


def silhouette(shape: str, cy: float, cx: float, size: float) -> np.ndarray:
    """`shape`'s filled silhouette, white on black: the silhouette ControlNet's control image."""
    from engine.models.shapes.draw import shape_mask

    return np.repeat(shape_mask(shape, cy, cx, size)[..., None].astype(np.uint8) * 255, 3, axis=-1)


def outlined(image: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """`image` with the edge of `mask`'s white region drawn in white (how the grid shows a mask)."""
    inside = mask[..., 0] > 127
    padded = np.pad(inside, 1)
    interior = padded[:-2, 1:-1] & padded[2:, 1:-1] & padded[1:-1, :-2] & padded[1:-1, 2:]
    shown = image.copy()
    shown[inside & ~interior] = 255
    return shown


def _png(image: np.ndarray) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def label(spec: dict) -> str:
    text = spec["prompt"] or '""'
    if spec.get("negative_prompt"):
        text += f" (not {spec['negative_prompt']})"
    if spec.get("edit"):
        text += f"\n{spec['edit']}"
    return f"{text}\n{spec['sampler']} {spec['steps']} g{spec['guidance']:g}"


def tiles(requests: list[dict], images: list[np.ndarray | None], labels: list[str], columns: int = COLUMNS):
    """The grid's tiles: each request's output, an edit's input or a control image just before it, on the same
    row (an empty cell, (None, None), where the input would fall in the last column)."""
    count = 0
    for spec, image, text in zip(requests, images, labels):
        if spec.get("input") is not None:
            if count % columns == columns - 1:
                yield None, None
                count += 1
            note = ("\n(white line: the mask's edge)" if spec.get("mask") else
                    "\n(the ControlNet's control image)" if spec.get("controls") else "")
            yield spec["input"], "input of the next tile" + note
            count += 1
        yield image, text
        count += 1


def grid(images: list[np.ndarray | None], labels: list[str | None], columns: int = COLUMNS,
         scale: int = 4) -> np.ndarray:
    """The images as one grid, each tile labelled with its request (a label None: an empty cell)."""
    from PIL import Image, ImageDraw

    size = next((im.shape[0] for im in images if im is not None), 32) * scale
    text_h = 11 * max(text.count("\n") + 1 for text in labels if text is not None) + 4
    cell_w, cell_h = max(size, 150) + 6, size + text_h + 6
    rows = -(-len(images) // columns)
    canvas = Image.new("RGB", (columns * cell_w + 6, rows * cell_h + 6), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    for i, (image, text) in enumerate(zip(images, labels)):
        if text is None:
            continue
        r, c = divmod(i, columns)
        x, y = 6 + c * cell_w, 6 + r * cell_h
        if image is None:  # canceled: a grey tile with a cross
            tile = np.full((size, size, 3), 90, np.uint8)
            idx = np.arange(size)
            tile[idx, idx] = tile[idx, size - 1 - idx] = (220, 60, 60)
            text = "canceled: " + text
        else:
            tile = np.repeat(np.repeat(image, scale, axis=0), scale, axis=1)
        canvas.paste(Image.fromarray(tile), (x, y))
        draw.multiline_text((x, y + size + 2), text, fill=(0, 0, 0), spacing=1)
    return np.asarray(canvas)


def run(command: list[str], address: str, out_path: pathlib.Path, log_path: pathlib.Path) -> int:
    from PIL import Image

    from frontend import Canceled, Completed, GenerateParams

    with launched_engine(command, address, log_path) as (process, client):
        welcome = client.welcome
        # a text model's Welcome lists no prompts: the ones the embedded `shapes` knows
        prompts = [p for p in welcome.prompts if p] or list(SHAPES_PROMPTS)
        print(f"engine pid {welcome.engine_pid} on {address}: model {welcome.model} ({welcome.pipeline}), "
              f"{len(prompts)} prompts, native size {welcome.native_size}")
        adapters = client.adapters() if welcome.model == "shapes" else []
        controlnets = welcome.controlnets if welcome.model == "shapes" else []
        requests = plan(prompts, adapters, controlnets)
        started = time.monotonic()
        handles = []
        for spec in requests:
            params = GenerateParams(**{k: v for k, v in spec.items() if k not in ("cancel_at", "edit", "input")})
            handles.append(client.submit(params, progress="cancel_at" in spec))
        for spec, handle in zip(requests, handles):
            if "cancel_at" in spec:
                for progress in handle.progress(timeout=120):
                    if progress.step >= spec["cancel_at"]:
                        handle.cancel()
                        break
        results = [handle.result(timeout=600) for handle in handles]
        wall = time.monotonic() - started
        stats = client.stats()
    engine_pid = process.pid

    images = []
    for result in results:
        if isinstance(result, Completed):
            images.append(np.asarray(Image.open(io.BytesIO(result.output)).convert("RGB")))
        else:
            images.append(None)
    looks = _classify(images) if welcome.model == "shapes" else [""] * len(images)
    overlaps = [silhouette_iou(image, spec["input"]) if spec.get("controls") and image is not None else None
                for spec, image in zip(requests, images)]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    labels = [label(spec) + (f"\nreads: {look}" if look else "") for spec, look in zip(requests, looks)]
    Image.fromarray(grid(*zip(*tiles(requests, images, labels)))).save(out_path)

    header = (f"{'#':>2} {'prompt':<18} {'sampler':<15} {'steps':>5} {'g':>3} {'result':<9} {'queue_s':>8} "
              f"{'encode_s':>8} {'denoise_s':>9} {'dec_wait':>8} {'decode_s':>8} {'total_s':>8} {'evals':>5} "
              f"{'padded':>6}  {'looks like':<36} request")
    print(header)
    print("-" * len(header))
    ok = True
    for i, (spec, result, look, overlap) in enumerate(zip(requests, results, looks, overlaps)):
        notes = f", IoU {overlap:.2f} with control" if overlap is not None else ""
        outcome = type(result).__name__
        t = getattr(result, "timings", None)
        cells = (f"{t.queue_s:8.3f} {t.encode_s:8.3f} {t.denoise_s:9.3f} {t.decode_wait_s:8.3f} {t.decode_s:8.3f} {t.total_s:8.3f} "
                 f"{t.evals:5d} {t.padded_evals:6d}") if t else f"{getattr(result, 'reason', getattr(result, 'error', '')):<60}"
        print(f"{i:>2} {spec['prompt'][:18]:<18} {spec['sampler']:<15} {spec['steps']:>5} {spec['guidance']:>3g} "
              f"{outcome:<9} {cells}  {look + notes:<36} {spec.get('edit', '')}")
        expected = Canceled if "cancel_at" in spec else Completed
        ok &= isinstance(result, expected)
    # denoiser evaluations: those of completed requests over all spent, the canceled request's included
    useful = sum(r.timings.evals for r in results if isinstance(r, Completed))
    spent = sum(r.timings.evals for r in results if getattr(r, "timings", None) is not None)
    print(f"\n{len(results)} requests in {wall:.2f}s wall; useful/total evals {useful}/{spent} = "
          f"{useful / max(1, spent):.3f} (canceled: {spent - useful}); engine's padded-row ratio "
          f"{stats.get('useful_ratio', float('nan')):.3f}; grid written to {out_path}")

    leftovers = [name for name in os.listdir("/dev/shm") if name.startswith(f"{SEGMENT_PREFIX}{engine_pid}")] \
        if os.path.isdir("/dev/shm") else []
    if leftovers:
        print(f"error: shared memory left behind: {leftovers}", file=sys.stderr)
        ok = False
    if process.returncode != 0:
        print(f"error: engine exited with {process.returncode}:\n{log_path.read_text(errors='replace')[-2000:]}",
              file=sys.stderr)
        ok = False
    return 0 if ok else 1


def _classify(images: list[np.ndarray | None]) -> list[str]:
    """What the shapes classifier reads in each 32×32 image ("" for others and canceled)."""
    from engine.models.shapes.classify import UNKNOWN, classify

    return ["" if image is None or image.shape[:2] != (32, 32) else
            ("nothing" if (look := classify(image[None])[0]) == UNKNOWN else look) for image in images]


def silhouette_iou(image: np.ndarray, control: np.ndarray) -> float:
    """The IoU of the figure drawn in `image` (its saturated pixels, as bench/shapes_controlnet.py reads them)
    with the control's white silhouette."""
    from engine.models.shapes.classify import SATURATION

    pixels = image.astype(np.float32) / 255
    drawn = pixels.max(-1) - pixels.min(-1) > SATURATION
    inside = control[..., 0] > 127
    return float((drawn & inside).sum() / max(1, (drawn | inside).sum()))


def engine_command(args: argparse.Namespace, address: str) -> list[str]:
    command = [sys.executable, "-m", "engine", "serve", "--address", address, "--model", args.model,
               *(["--slots", str(args.slots)] if args.slots is not None else []),
               "--layout", args.layout, "--admission", args.admission,
               "--max-queue", str(args.max_queue), "--dtype", args.dtype,
               *(["--decode-workers", str(args.decode_workers)] if args.decode_workers is not None else [])]
    for flag, value in (("--revision", args.revision), ("--variant", args.variant), ("--config", args.config),
                        ("--device", args.device)):
        if value:
            command += [flag, value]
    lora_dir = args.lora_dir or (str(SHAPES_LORAS) if args.model == "shapes" and SHAPES_LORAS.is_dir() else None)
    if lora_dir:
        command += ["--lora-dir", lora_dir]
    controlnets = args.controlnets or ([f"{SILHOUETTE}={SHAPES_CONTROLNET}"] if args.model == "shapes" and
                                       (SHAPES_CONTROLNET / "config.json").is_file() else [])
    for spec in controlnets:
        command += ["--controlnet", spec]
    if args.ip_adapter:
        command += ["--ip-adapter", args.ip_adapter]
    if not args.cuda_graphs:
        command += ["--no-cuda-graphs"]
    return command


def main(args: argparse.Namespace) -> int:
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="demo-", dir=transport.runtime_dir()))
    address = f"ipc://{workdir / 'engine.sock'}"
    try:
        return run(engine_command(args, address), address, pathlib.Path(args.out), workdir / "engine.log")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
