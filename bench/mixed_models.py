"""Mixed sizes on SDXL, FLUX and Qwen-Image: how a step-level engine batches a backend's
traffic of many sizes, samplers and per-request inputs, on tiny random-weight folders.

    python bench/mixed_models.py [--requests 48] [--slots 8] [--threads 2] [--policy fifo|srpt] [--quick]

For a tiny SDXL folder and a tiny FLUX-dev folder (`engine.testing.tiny_pipelines`), one
trace each, all queued at once: three sizes, step counts 4/10/20, samplers mixed (SDXL:
euler, ddim, dpmpp_2m; FLUX: default, flow_euler), guidance 1–7 (FLUX: embedded guidance,
some `true_cfg` requests with a negative prompt), SDXL crops and original sizes per
request, a few cancels; and a tiny Qwen-Image folder (`engine.testing.tiny_qwen_image`)
whose prompts and negative prompts have different token counts, with `true_cfg` on and
off. Reported per model: completed, canceled, denoiser calls, groups (one per size: the
only key besides the model), useful rows per call, and how many calls mixed rows of
different per-request inputs (time ids, embedded guidance), of prompts of different
lengths (Qwen-Image: a call padded to its longest prompt, with the mask) and of
different steps — what a request-level batcher keyed by those could not share.
"""
from __future__ import annotations

import argparse
import pathlib
import tempfile
import time

import torch

from engine.core import CoreConfig, DenoiseFinished, EngineCore, RequestCanceled
from engine.models.loading import load_model
from engine.protocol import GenerateParams
from engine.testing.tiny_pipelines import build_flux, build_sdxl
from engine.testing.tiny_qwen_image import build_qwen_image

PROMPTS = ("a red circle", "a big blue cat", "the small green dog", "a photo of a yellow cross")
#: Qwen-Image prompts of 1 to 11 words: each a different number of tokens
QWEN_PROMPTS = ("dog", "a red circle", "a big blue cat with a small green dog", "a photo of a yellow cross",
                "a small green triangle over blue hills with a red sky", "cat")


def trace(kind: str, n: int, sizes: list[int]) -> list[tuple[str, GenerateParams, bool]]:
    out = []
    for k in range(n):
        size = sizes[k % len(sizes)]
        steps = (4, 10, 20)[(k // 3) % 3]  # not tied to the size: each group mixes step counts
        common = dict(prompt=PROMPTS[k % len(PROMPTS)], steps=steps, seed=k, height=size, width=size, output="latent")
        if kind == "sdxl":
            params = GenerateParams(**common, sampler=("euler", "ddim", "dpmpp_2m")[k % 3], guidance=(1.0, 3.0, 7.0)[k % 3],
                                    crops_coords_top_left=(0, 4 * (k % 2)), original_size=(size + 8 * (k % 3), size))
        elif kind == "flux":
            true_cfg = k % 4 == 1
            params = GenerateParams(**common, sampler=("default", "flow_euler")[k % 2], guidance=1.0 + k % 5,
                                    negative_prompt="blurry" if true_cfg else None, true_cfg=2.0 if true_cfg else 1.0)
        else:  # Qwen-Image: prompts of several lengths, true CFG with negative prompts of others
            true_cfg = k % 3 == 1
            common["prompt"] = QWEN_PROMPTS[k % len(QWEN_PROMPTS)]
            params = GenerateParams(**common, sampler=("default", "flow_euler")[k % 2],
                                    negative_prompt=("blurry", "a bad photo")[k % 2] if true_cfg else None,
                                    true_cfg=4.0 if true_cfg else 1.0)
        out.append((f"{kind}{k}", params, steps == 20 and k % 5 == 2))
    return out


def distinct_rows(value: torch.Tensor) -> int:
    """How many different values the rows of one call's per-row input hold (a row of SDXL
    time ids is six numbers). Compared by value: rows taken one by one as tensors are new
    objects each time, so a set of them would count every row as different."""
    return len({tuple(row) for row in value.reshape(len(value), -1).tolist()})


def run(model, jobs, slots: int, policy: str | None = None) -> dict:
    policy_field = {} if policy is None else {"policy": policy}  # None: the engine's default
    core = EngineCore(model, CoreConfig(slots=slots, max_queue=len(jobs) + 1, decode_buffers=2 * slots,
                                        trajectory_budget_bytes=1 << 30, output_budget_bytes=1 << 30,
                                        **policy_field))
    calls = {"n": 0, "rows": 0, "mixed_inputs": 0, "mixed_lengths": 0, "mixed_steps": 0}
    inner = model.run

    def counting(inputs):
        calls["n"] += 1
        calls["rows"] += inputs.rows
        for field in ("time_ids", "guidance"):
            value = getattr(inputs, field)
            if value is not None and distinct_rows(value) > 1:
                calls["mixed_inputs"] += 1
                break
        if inputs.hidden_mask is not None:  # rows whose prompts differ in length, padded in one call
            calls["mixed_lengths"] += 1
        if len(set(inputs.timestep.tolist())) > 1:
            calls["mixed_steps"] += 1
        return inner(inputs)

    model.run = counting
    victims = {rid for rid, _, cancel in jobs if cancel}
    done = canceled = 0
    groups = set()
    start = time.perf_counter()
    try:
        for rid, params, _ in jobs:
            core.add_request(rid, params)
        while core.has_unfinished_requests():
            groups |= set(core.groups)
            for out in core.step():
                if isinstance(out, DenoiseFinished):
                    core.decode_done(out.request_id)
                    done += 1
                elif isinstance(out, RequestCanceled):
                    canceled += 1
                elif getattr(out, "step", 0) == 5 and out.request_id in victims:
                    core.abort_requests([out.request_id])
    finally:
        del model.run
    wall = time.perf_counter() - start
    useful = core.stats()["useful_evals"]
    return dict(done=done, canceled=canceled, calls=calls["n"], groups=len(groups), wall=wall,
                useful_rows_per_call=useful / max(1, calls["n"]), rows_per_call=calls["rows"] / max(1, calls["n"]),
                mixed_inputs=calls["mixed_inputs"], mixed_lengths=calls["mixed_lengths"],
                mixed_steps=calls["mixed_steps"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--policy", choices=("fifo", "srpt"), default=None,
                        help="admission order (default: the engine's)")
    parser.add_argument("--quick", action="store_true", help="12 requests a model")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.slots = 12, 2
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folders = {"sdxl": (build_sdxl(pathlib.Path(tmp) / "sdxl"), [16, 24, 32]),
                   "flux": (build_flux(pathlib.Path(tmp) / "flux", guidance_embeds=True), [32, 48, 64]),
                   "qwen": (build_qwen_image(pathlib.Path(tmp) / "qwen"), [32, 48, 64])}
        print(f"{args.requests} requests a model, {args.slots} slots, {args.threads} torch threads, "
              f"policy {args.policy or 'the engine default'}")
        print(f"{'model':<6} {'done':>5} {'canc':>5} {'calls':>6} {'groups':>7} {'useful rows/call':>17} "
              f"{'calls mixing inputs':>20} {'calls mixing prompt lengths':>28} {'calls mixing steps':>19} "
              f"{'wall s':>7}")
        for kind, (folder, sizes) in folders.items():
            r = run(load_model(folder), trace(kind, args.requests, sizes), args.slots, args.policy)
            print(f"{kind:<6} {r['done']:>5} {r['canceled']:>5} {r['calls']:>6} {r['groups']:>7} "
                  f"{r['useful_rows_per_call']:>17.1f} {r['mixed_inputs']:>20} {r['mixed_lengths']:>28} "
                  f"{r['mixed_steps']:>19} {r['wall']:>7.1f}")


if __name__ == "__main__":
    main()
