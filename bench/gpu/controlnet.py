"""Part `controlnet`: per-request ControlNets on the device. An SD-1.5-architecture UNet
(random weights, SD 1.5's config from `sd15`, fp16, 512² → 4×64×64; one layer per block
instead of two with --quick: real widths, the ratios rather than the absolute rates) in
the engine's own `StableDiffusionModel`, and two ControlNets built from it as diffusers'
tests build them (`ControlNetModel.from_unet`, the zero-initialised projections made
random, as `engine.testing.tiny_conditioning.build_controlnet` does: otherwise their
residuals are zeros and the equality checks below would show nothing).

The three systems of `bench/controlnet.py`, side by side in one run:

  mixed     each ControlNet runs once per call on the rows that use it (the engine);
  keyed     a request's group key also holds its ControlNet names: requests share a call
            only with requests of the same ControlNets;
  all-rows  every ControlNet used in a call runs on every row of it (scale 0 where unused).

(a) One denoiser call's cost (CUDA-synchronised, warm-up, median of N) at 16 guided
requests (32 rows) with 30% of them (5: 3 on one ControlNet, 2 on the other) using a
ControlNet, through the engine's own path (`ControlSlots.call` gathers the call's
`ControlCall`, `model.run` runs it): a plain call, the mixed call, the keyed split (the
three calls keyed groups make for the same rows: plain, one per ControlNet) and the
all-rows call. The per-row outputs of the keyed split and of all-rows must equal the mixed
call's, and the ControlNet rows must differ from a plain call's (the ControlNets acted).
Verdict `judge.controlnet_gathered_cost`.

(b) If the estimate from (a) fits the part's time (≤ 60 s, ≤ 25 s with --quick, the
model's build included): a saturated burst of requests (`bench/controlnet.py`'s trace:
steps 4/10/20, euler, guidance 3, 30% on one of the two ControlNets) served to the end by
each system: goodput (completions / makespan), p50 of the 4-step requests, denoiser calls
and ControlNet rows run. Verdict `judge.controlnet_over_keyed` on mixed / keyed goodput;
if (b) does not fit, on the split's cost over the mixed call's (what keyed groups pay per
step of the same rows).

Every request asks for the native size: without one, a request takes its control image's
size (as the pipeline does), and small control images would put the ControlNet requests
in groups of their own shape in every system.
"""
from __future__ import annotations

import contextlib
import functools
import io
import pathlib
import random
import statistics
import time
import types

import numpy as np
import torch
from diffusers import ControlNetModel, UNet2DConditionModel
from PIL import Image

from bench.controlnet import (GUIDANCE, NETS, SAMPLER, STEP_CLASSES, SYSTEMS, every_row, make_core, make_trace,
                              silhouette)
from engine.core import DenoiseFinished, RequestFailed
from engine.core.input_kinds.controls import ControlSlot, ControlSlots
from engine.models.controlnet import ControlEntry, check_controlnet, control_factors
from engine.models.geometry import Geometry
from engine.models.model import Conditioning, model_inputs
from engine.models.stable_diffusion import StableDiffusionModel
from engine.protocol import Control, GenerateParams

from . import judge
from .report import check, row
from .sd15 import SD15_SCHEDULER_CONFIG, SD15_UNET_CONFIG
from .text_stand_in import TEXT_TOKENS, random_rows

PART = "controlnet"
SLOTS, SHARE = 16, 0.3
#: the part's own time, the model's build included (the whole gpu_check stays within 420 s)
BUDGET_S, QUICK_BUDGET_S = 60.0, 25.0
VAE_SCALE = 8  # SD's VAE: 8 pixels per latent cell; the control image is prepared at the output's size
#: per-row outputs of one call against the mixed call's (fp16: other batch sizes, other kernels)
CALL_TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 3e-2, torch.float32: 1e-4}
#: a ControlNet row's output must move at least this many tolerances off a plain call's
#: (the random ControlNets at SD 1.5's widths move it by about 0.3, measured in fp32 on CPU)
EFFECT_OVER_TOLERANCE = 5
PROMPTS = tuple(f"prompt {k}" for k in range(8))


def sd15_config(quick: bool) -> dict:
    """SD 1.5's UNet config; --quick keeps its widths with one layer per block instead of two."""
    return dict(SD15_UNET_CONFIG, layers_per_block=1) if quick else dict(SD15_UNET_CONFIG)


def random_controlnet(unet, seed: int, gain: float = 0.3):
    """`ControlNetModel.from_unet` on the UNet (its down and mid blocks' weights), on the
    UNet's device and dtype, the zero-initialised convolutions (the residual projections,
    the conditioning embedding's last conv) given random weights, as `build_controlnet`."""
    torch.manual_seed(seed)
    with torch.device(unet.device):
        net = ControlNetModel.from_unet(unet)
    generator = torch.Generator().manual_seed(seed)
    zeroed = [*net.controlnet_down_blocks, net.controlnet_mid_block, net.controlnet_cond_embedding.conv_out]
    with torch.no_grad():
        for conv in zeroed:
            weight = torch.randn(conv.weight.shape, generator=generator) * gain / conv.weight[0].numel() ** 0.5
            conv.weight.copy_(weight)
            conv.bias.copy_(torch.randn(conv.bias.shape, generator=generator) * gain * 0.1)
    return net.to(unet.dtype).eval().requires_grad_(False)


def controlnet_model(unet_config: dict, device="cuda", dtype=torch.float16, native_size: int = 512,
                     text_tokens: int = TEXT_TOKENS):
    """The engine's own `StableDiffusionModel` on a random-weight UNet of `unet_config` (the
    pipeline reduced to what the class reads; prompts map to fixed random rows), serving the
    two ControlNets `NETS` built from it (each checked as `--controlnet` checks one)."""
    width = int(unet_config["cross_attention_dim"])
    halvings = len(unet_config["block_out_channels"]) - 1

    class Sd15WithControlNets(StableDiffusionModel):
        def __init__(self):
            self.path = pathlib.Path("sd15-architecture-random-controlnets")
            self.device, self.dtype = torch.device(device), dtype
            torch.manual_seed(0)
            with torch.device(device):
                unet = UNet2DConditionModel(**unet_config)
            unet = unet.to(dtype).eval().requires_grad_(False)
            self.pipe = types.SimpleNamespace(unet=unet, vae=None, vae_scale_factor=VAE_SCALE)
            self.vae = None
            self.scheduler_config = dict(SD15_SCHEDULER_CONFIG)

        @functools.cached_property
        def geometry(self) -> Geometry:
            return Geometry(latent_channels=4, vae_scale=VAE_SCALE, size_multiple=VAE_SCALE * 2 ** halvings,
                            native_size=native_size)

        def encode(self, prompts):
            return [Conditioning(random_rows(p or "", (text_tokens, width), self.device, self.dtype)) for p in prompts]

    model = Sd15WithControlNets()
    nets = {name: random_controlnet(model.denoiser, seed=k + 1) for k, name in enumerate(NETS)}
    for name, net in nets.items():
        why = check_controlnet(net, model)
        if why:
            raise ValueError(f"ControlNet {name}: {why}")
    model.controlnets = nets
    return model


@contextlib.contextmanager
def controlnet_rows(model):
    """While it lasts, the rows each ControlNet runs on are counted ({name: rows}, updated
    in place)."""
    counts = {name: 0 for name in model.controlnets}

    def counter(name):
        def count(module, args):
            counts[name] += int(args[0].shape[0])
        return count

    hooks = [net.register_forward_pre_hook(counter(name)) for name, net in model.controlnets.items()]
    try:
        yield counts
    finally:
        for hook in hooks:
            hook.remove()


# ---- (a) one call ----------------------------------------------------------------------------

def slot_controls(slots: int, share: float) -> list[str | None]:
    """Which ControlNet each of `slots` requests uses (None: none): `share` of them, the
    two ControlNets in turn."""
    using = max(1, round(share * slots))
    return [NETS[k % len(NETS)] if k < using else None for k in range(slots)]


def call_costs(model, slots: int = SLOTS, share: float = SHARE, samples: int = 10, warmup: int = 3) -> dict:
    """One denoiser call's worth of `slots` guided requests (2 rows each), `share` of them
    on a ControlNet, through the engine's own path: median ms of a plain call, the mixed
    call, the keyed split (its calls back to back) and the all-rows call; the ControlNet rows
    each ran; each row's output's relative L2 against the mixed call's (`errors`) and the
    ControlNet rows' against a plain call's (`effect`)."""
    device = model.device
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    uses = slot_controls(slots, share)
    size = model.native_size
    shape = model.latent_shape(size, size)
    generator = torch.Generator(device).manual_seed(0)
    sample = torch.randn(2 * slots, *shape, device=device, generator=generator, dtype=model.dtype)
    timestep = torch.full((2 * slots,), 500.0, device=device)
    conditions = model.encode([p for k in range(slots) for p in (PROMPTS[k % len(PROMPTS)], "")])
    entries = {}  # slot → its one control, at step 0 of a one-step window, scales 1.0 and 0.7 in turn
    for k, name in enumerate(uses):
        if name is not None:
            net = model.controlnets[name]
            image = Image.open(io.BytesIO(silhouette(random.Random(k))))
            prepared = model.prepare_control_image(image, size, size, None, net)
            entries[k] = ControlEntry(name, prepared, np.ones(1, dtype=bool),
                                      control_factors(1.0 if k % 2 == 0 else 0.7, False, net))

    def call_of(slot_ids: list[int]):
        """A denoiser call of these requests' rows, its ControlCall gathered each time as
        the runner gathers it; returns (run it, its rows in `sample`)."""
        rows = np.array([2 * s + b for s in slot_ids for b in (0, 1)])
        state = ControlSlots(device)
        for position, s in enumerate(slot_ids):
            if s in entries:
                state.place(position, ControlSlot([entries[s]], False, False, 0))
        row_slot = np.repeat(np.arange(len(slot_ids)), 2)
        branch = np.tile([0, 1], len(slot_ids))
        real = np.ones(len(rows), dtype=bool)
        steps = np.zeros(len(slot_ids), dtype=np.int64)
        index = torch.from_numpy(rows).to(device)
        inputs = model_inputs(sample.index_select(0, index), timestep.index_select(0, index),
                              [conditions[r] for r in rows.tolist()])

        def run():
            inputs.controls = state.call(model.controlnets, row_slot, branch, steps, real)
            return model.run(inputs)

        return run, rows

    everyone = list(range(slots))
    keyed_groups = [[s for s in everyone if uses[s] == name] for name in (None, *NETS)]
    keyed_groups = [g for g in keyed_groups if g]
    plain_call = model_inputs(sample, timestep, conditions)
    mixed, _ = call_of(everyone)
    split = [call_of(g) for g in keyed_groups]

    def keyed():
        return [run() for run, _ in split]

    def timed(fn) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(samples):
            sync()
            started = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - started)
        return 1e3 * statistics.median(times)

    ran = {}
    with torch.no_grad():
        plain_out = model.run(plain_call).float()
        outputs = {}
        for system in SYSTEMS:
            with controlnet_rows(model) as counts, every_row() if system == "all-rows" else contextlib.nullcontext():
                if system == "keyed":
                    out = torch.empty_like(plain_out)
                    for (_, rows), part in zip(split, keyed()):
                        out[torch.from_numpy(rows).to(device)] = part.float()
                else:
                    out = mixed().float()
            outputs[system], ran[system] = out, counts
        ms = {"plain": timed(lambda: model.run(plain_call)), "mixed": timed(mixed), "keyed": timed(keyed)}
        with every_row():
            ms["all-rows"] = timed(mixed)

    def rel(a, b):
        return float((a - b).norm() / b.norm().clamp_min(1e-12))

    mixed_out = outputs["mixed"]
    control_rows = [2 * s + b for s in entries for b in (0, 1)]
    return dict(ms=ms, ran=ran, keyed_calls=[2 * len(g) for g in keyed_groups], rows=2 * slots,
                errors={f"{system} row {r}": rel(outputs[system][r], mixed_out[r]) for system in ("keyed", "all-rows")
                        for r in range(2 * slots)},
                effect=min(rel(mixed_out[r], plain_out[r]) for r in control_rows),
                plain_rows_changed=max(rel(mixed_out[r], plain_out[r]) for r in range(2 * slots)
                                       if r not in control_rows))


# ---- (b) a saturated trace -------------------------------------------------------------------

def system_core(system: str, model, slots: int, requests: int):
    return make_core(system, model, slots, max_queue=requests + 1)


def burst(requests: int, share: float, seed: int) -> list[dict]:
    """`bench/controlnet.py`'s trace, every request at once: [{id, steps, prompt, seed, controls}]."""
    return make_trace(seed, None, 0.0, list(PROMPTS), share, count=requests)


def params_of(entry: dict, size: int) -> GenerateParams:
    controls = tuple(Control(name, image, scale=scale) for name, image, scale in entry["controls"])
    return GenerateParams(prompt=entry["prompt"], negative_prompt="", steps=entry["steps"], sampler=SAMPLER,
                          guidance=GUIDANCE, seed=entry["seed"], output="latent", height=size, width=size,
                          controls=controls)


def serve(model, system: str, trace: list[dict], slots: int, limit_s: float) -> dict:
    """The whole trace added at once and served to the end by `system`: goodput
    (completions / makespan), p50 of the shortest requests, denoiser calls, mean rows per
    call, ControlNet rows run; each request's final latents."""
    cuda = model.device.type == "cuda"
    size = model.native_size
    params = {entry["id"]: params_of(entry, size) for entry in trace}
    core = system_core(system, model, slots, len(trace))
    done, latents, failed = {}, {}, {}
    with (controlnet_rows(model) as counts, every_row() if system == "all-rows" else contextlib.nullcontext(),
          torch.no_grad()):
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        for entry in trace:
            core.add_request(entry["id"], params[entry["id"]])
        while core.has_unfinished_requests():
            for out in core.step():
                if isinstance(out, DenoiseFinished):
                    done[out.request_id] = time.perf_counter() - started
                    latents[out.request_id] = out.latents.float().clone()
                    core.decode_done(out.request_id)
                elif isinstance(out, RequestFailed):
                    failed[out.request_id] = out.error
            if time.perf_counter() - started > limit_s:
                raise RuntimeError(f"{system}: {len(done)} of {len(trace)} requests done in {limit_s:.0f} s")
    stats = core.stats()
    short = [done[e["id"]] for e in trace if e["steps"] == STEP_CLASSES[0] and e["id"] in done]
    makespan = max(done.values(), default=float("nan"))
    rows = int(stats["useful_evals"]) + int(stats["padded_evals"])
    return dict(system=system, completed=len(done), failed=failed, goodput=len(done) / makespan if done else 0.0,
                p50_short=statistics.median(short) if short else float("nan"), calls=core.calls,
                rows_per_call=rows / core.calls if core.calls else float("nan"),
                controlnet_rows=sum(counts.values()), latents=latents)


def warm_up_burst() -> list[dict]:
    """Four requests of the shortest steps, two on a ControlNet: kernels, the update
    kernel's compile, the allocator, before anything is timed."""
    warm = burst(4, 0.5, 100)
    for entry in warm:
        entry["steps"] = STEP_CLASSES[0]
    return warm


def replay(model, trace: list[dict], slots: int = SLOTS, limit_s: float = 600.0) -> dict:
    """The three systems on one burst (after the warm-up burst through each); their
    results by system and the worst relative L2 of a request's latents against mixed's."""
    for system in SYSTEMS:
        serve(model, system, warm_up_burst(), slots, limit_s)
    results = {system: serve(model, system, trace, slots, limit_s) for system in SYSTEMS}
    mixed = results["mixed"]["latents"]
    worst = max((float((r["latents"][rid] - mixed[rid]).norm() / mixed[rid].norm())
                 for system, r in results.items() if system != "mixed" for rid in r["latents"] if rid in mixed),
                default=float("inf"))
    return dict(results=results, worst_rel_l2=worst, using=sum(bool(e["controls"]) for e in trace))


def replay_estimate_s(ms: dict, trace: list[dict], slots: int) -> float:
    """Seconds `replay` should take: for each burst (the warm-up's and the trace), full
    calls of `slots` requests for its request-steps, then its longest request's steps
    alone, at each system's cost of one call's worth of rows (the keyed split for keyed),
    with a margin."""
    calls = sum(sum(e["steps"] for e in b) / slots + max(e["steps"] for e in b) for b in (warm_up_burst(), trace))
    return 1.5 * calls * sum(ms[s] for s in SYSTEMS) / 1e3


# ---- the part ----------------------------------------------------------------------------------

def report_call(cost: dict, dtype: torch.dtype, slots: int) -> float:
    """(a)'s rows and checks; returns the keyed split's cost over the mixed call's."""
    ms = cost["ms"]
    using = sum(1 for name in slot_controls(slots, SHARE) if name is not None)
    case = f"one call, {slots} guided requests ({cost['rows']} rows), {using} on a ControlNet"
    notes = {"plain": "no ControlNet", "mixed": "one call", "all-rows": "one call",
             "keyed": f"{len(cost['keyed_calls'])} calls of {'/'.join(map(str, cost['keyed_calls']))} rows"}
    for system in ("plain", *SYSTEMS):
        ran = cost["ran"].get(system)
        note = notes[system] + ("; ControlNet rows " + ", ".join(f"{n} {r}" for n, r in ran.items()) if ran else "")
        row(PART, case, f"{system} median ms", ms[system], "info", note)
    tolerance = CALL_TOLERANCE[dtype]
    verdict = judge.equal_within(cost["errors"], tolerance)
    check(PART, case, "rows of keyed and all-rows vs mixed", max(cost["errors"].values()), verdict.ok,
          f"rel L2 per row; {verdict.note}")
    acted = cost["effect"] > EFFECT_OVER_TOLERANCE * tolerance and cost["plain_rows_changed"] <= tolerance
    check(PART, case, "ControlNet rows vs a plain call (min)", cost["effect"], acted,
          f"rel L2; > {EFFECT_OVER_TOLERANCE * tolerance:g} (the ControlNets acted, so the equality above shows "
          f"something); the other rows' largest {cost['plain_rows_changed']:.2g} (≤ {tolerance:g}: they paid nothing)")
    verdict = judge.controlnet_gathered_cost(ms["plain"], ms["mixed"], ms["all-rows"])
    check(PART, case, "mixed ms / plain ms", ms["mixed"] / ms["plain"], verdict.ok, verdict.note)
    split = ms["keyed"] / ms["mixed"]
    row(PART, case, "keyed split ms / mixed ms", split, "info",
        f"what keyed groups pay per step of the same rows; all-rows / mixed {ms['all-rows'] / ms['mixed']:.2f}")
    return split


def report_replay(result: dict, requests: int, slots: int) -> float:
    """(b)'s rows and its verdict; returns mixed / keyed goodput."""
    results = result["results"]
    case = (f"burst of {requests} requests, {result['using']} on a ControlNet, steps "
            f"{'/'.join(map(str, STEP_CLASSES))}, {slots} slots")
    for system in SYSTEMS:
        r = results[system]
        row(PART, case, f"{system} goodput /s", r["goodput"], "info",
            f"{r['completed']} done, {len(r['failed'])} failed; {r['calls']} calls of {r['rows_per_call']:.1f} rows; "
            f"ControlNet rows {r['controlnet_rows']}; p50 4-step {r['p50_short']:.2f} s")
    complete = all(r["completed"] == requests and not r["failed"] for r in results.values())
    goodput = {system: results[system]["goodput"] for system in SYSTEMS}
    ratio = goodput["mixed"] / goodput["keyed"] if goodput["keyed"] > 0 else 0.0
    verdict = judge.controlnet_over_keyed(ratio, "goodput", complete)
    check(PART, case, "mixed / keyed goodput", ratio, verdict.ok, verdict.note)
    row(PART, case, "mixed / all-rows goodput", goodput["mixed"] / goodput["all-rows"] if goodput["all-rows"] else 0.0,
        "info", f"worst rel L2 of a request's latents against mixed {result['worst_rel_l2']:.2g} (other batch "
        "compositions)")
    return ratio


def measure(model, budget_s: float, started: float, slots: int = SLOTS, requests: int = 48,
            samples: int = 10) -> dict:
    """(a), then (b) if its estimate fits what is left of `budget_s` since `started`
    (perf_counter), else the verdict on (a)'s split cost; the figures, rows written."""
    cost = call_costs(model, slots, SHARE, samples=samples)
    split = report_call(cost, model.dtype, slots)
    figures = dict(call_ms=cost["ms"], split_over_mixed=split, replayed=False)
    trace = burst(requests, SHARE, 1)
    left = budget_s - (time.perf_counter() - started)
    estimate = replay_estimate_s(cost["ms"], trace, slots)
    if estimate > left:
        row(PART, f"burst of {requests} requests", "replay", "not run", "skipped",
            f"estimated {estimate:.0f} s, {left:.0f} s left of the part's {budget_s:g} s")
        verdict = judge.controlnet_over_keyed(split, "the keyed split's call cost over mixed's", True)
        check(PART, f"one call, {slots} guided requests", "mixed / keyed (call cost)", split, verdict.ok,
              verdict.note)
        figures["over_keyed"] = split
    else:
        result = replay(model, trace, slots, limit_s=max(2 * left, 30.0))
        figures.update(over_keyed=report_replay(result, requests, slots), replayed=True,
                       goodput={s: r["goodput"] for s, r in result["results"].items()},
                       worst_rel_l2=result["worst_rel_l2"])
    row(PART, "whole part", "wall s", time.perf_counter() - started, "info", f"budget {budget_s:g} s")
    return figures


def run(args) -> dict:
    quick = getattr(args, "quick", False)
    started = time.perf_counter()
    config = sd15_config(quick)
    model = controlnet_model(config)
    torch.cuda.synchronize()
    params = sum(p.numel() for p in model.denoiser.parameters())
    net_params = sum(p.numel() for p in model.controlnets[NETS[0]].parameters())
    row(PART, "SD-1.5 UNet + 2 ControlNets (from_unet)", "built (s)", time.perf_counter() - started, "info",
        f"UNet {params / 1e6:.0f} M, each ControlNet {net_params / 1e6:.0f} M parameters "
        f"({config['layers_per_block']}/2 layers per block; real widths), fp16, random weights, 512²")
    return measure(model, QUICK_BUDGET_S if quick else BUDGET_S, started, requests=24 if quick else 48,
                   samples=5 if quick else 10)
