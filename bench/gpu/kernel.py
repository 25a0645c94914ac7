"""Part `kernel`: the compiled update kernel against the torch reference on CUDA, bit for
bit (NaN where NaN): random cases in fp32/bf16/fp16 model outputs, every sampler's
coefficient pattern (each kernel sampler × prediction type, first/middle/last steps), NaN
model outputs, a learned-sigma `out[:, :C]` view. Device guards, where there is a second
device: the kernel, a fence and a whole EngineCore on cuda:N while another device is
current (the engine against CPU). The inpainting blend kernel against its reference, bit
for bit."""
from __future__ import annotations

import torch

from engine.testing.reference import rel_l2
from engine.testing.tiny_pipelines import SCHEDULER_CONFIGS

from .cancel_plan import run_plan
from .engine_internals import CudaFences, build_schedule
from .kernel_cases import compare_kernel, random_inputs
from .report import check, row


SAMPLER_CASES = [  # (sampler, prediction type) pairs the kernel runs
    ("euler", "epsilon"), ("euler", "v_prediction"), ("euler", "sample"),
    ("euler_ancestral", "epsilon"), ("euler_ancestral", "v_prediction"),
    ("ddim", "epsilon"), ("ddim", "v_prediction"), ("ddim", "sample"),
    ("dpmpp_2m", "epsilon"), ("dpmpp_2m", "v_prediction"), ("dpmpp_2m", "sample"), ("dpmpp_2m", "flow"),
    ("flow_euler", "flow"),
]


def run(args) -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for entries, shape, seed in ((64, (4, 64, 64), 1), (37, (4, 24, 40), 2)):
            compare_kernel("kernel", f"random {entries}x{'x'.join(map(str, shape))} {str(dtype)[6:]}",
                           random_inputs(entries, shape, dtype, seed=seed))
    steps = 20
    for sampler, prediction in SAMPLER_CASES:
        schedule = build_schedule(sampler, dict(SCHEDULER_CONFIGS[prediction]), steps, 7.5)
        at = [0, 1, steps // 2, steps - 2, steps - 1] * 4
        coefs = torch.from_numpy(schedule.coefs[at]).clone()
        stochastic = [schedule.stochastic] * len(at)
        compare_kernel("kernel", f"{sampler}/{prediction} steps 0,1,{steps // 2},-2,-1",
                       random_inputs(len(at), (4, 32, 32), torch.float16, seed=3, coefs=coefs, stochastic=stochastic))
    compare_kernel("kernel", "NaN model outputs (10%)", random_inputs(32, (4, 32, 32), torch.float32, seed=5,
                                                                       nan_fraction=0.1))
    t = random_inputs(16, (4, 32, 32), torch.float16, seed=6)
    rows_, numel = t["model_out"].shape
    wide = torch.full((rows_, 2 * numel), 31337.0, dtype=t["model_out"].dtype, device="cuda")
    wide[:, :numel] = t["model_out"]
    t["model_out"] = wide[:, :numel]  # a learned-sigma model's out[:, :C]
    compare_kernel("kernel", "learned-sigma out[:, :C] view", t)
    blend_cases()
    if torch.cuda.device_count() > 1:  # device guards: every launch on its tensors' device, not the current one
        current = torch.cuda.current_device()
        other = next(d for d in range(torch.cuda.device_count()) if d != current)
        case = f"cuda:{other} while cuda:{current} is current"
        t = random_inputs(16, (4, 32, 32), torch.float32, seed=7, device=f"cuda:{other}")
        compare_kernel("kernel", case, t)
        fence = CudaFences(torch.device(f"cuda:{other}")).record()
        check("kernel", case, f"fence on cuda:{other}", str(fence.device),
              fence.device == torch.device(f"cuda:{other}"))
        torch.backends.cuda.matmul.allow_tf32 = False  # as the reaper part: fp32 convs without TF32 match the CPU
        torch.backends.cudnn.allow_tf32 = False
        on_other, _, _, _ = run_plan(f"cuda:{other}", hold_at_cancel=False)  # a whole EngineCore on cuda:N
        on_cpu, _, _, _ = run_plan("cpu", hold_at_cancel=False)
        worst = max((rel_l2(on_other[k], on_cpu[k]) for k in on_cpu if k in on_other), default=float("inf"))
        check("kernel", f"EngineCore on {case}", "max rel L2 vs cpu", worst,
              sorted(on_other) == sorted(on_cpu) and worst <= 1e-4, f"{len(on_other)} requests finished")
    else:
        row("kernel", "cuda:N while another device is current", "second device", torch.cuda.device_count(), "skipped",
            "one device")


def blend_cases() -> None:
    """The inpainting blend kernel (`blend_known_region_triton`) on CUDA against its torch
    reference, bit for bit: SD-sized slots (4×64×64 and 4×128×128 latents), a subset of
    slots as entries, binary and soft masks, a final step's (1, 0) coefficients; slots
    outside the entries untouched."""
    from .engine_internals import blend_known_region_reference, blend_known_region_triton

    for n, (slots, entries, shape, soft) in enumerate(((16, 11, (4, 64, 64), False), (8, 8, (4, 128, 128), True),
                                                       (5, 1, (4, 24, 40), False))):
        g = torch.Generator().manual_seed(40 + n)
        numel = shape[0] * shape[1] * shape[2]
        mask = torch.rand(slots, numel, generator=g)
        mask = mask if soft else (mask < 0.4).float()
        coefs = torch.rand(entries, 2, generator=g)
        coefs[-1] = torch.tensor([1.0, 0.0])
        t = dict(latents=torch.randn(slots, numel, generator=g) * 3,
                 image_latents=torch.randn(slots, numel, generator=g), noise=torch.randn(slots, numel, generator=g),
                 mask=mask,
                 index=torch.randperm(slots, generator=g)[:entries].to(torch.int32), coefs=coefs)
        ref = {k: v.clone() for k, v in t.items()}
        blend_known_region_reference(**ref)
        got = {k: v.cuda() for k, v in t.items()}
        blend_known_region_triton(**got)
        same = bool(torch.equal(got["latents"].cpu(), ref["latents"]))
        check("kernel", f"inpaint blend {entries}/{slots} slots x{'x'.join(map(str, shape))}"
              + (" soft mask" if soft else ""), "latents bitwise = reference", same, same,
              "" if same else f"max|Δ| {float((got['latents'].cpu() - ref['latents']).abs().max()):.3g}")
