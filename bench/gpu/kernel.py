"""Part `kernel`: the compiled update kernel against the torch reference on CUDA, bit for
bit (NaN where NaN): random cases in fp32/bf16/fp16 model outputs, every sampler's
coefficient pattern (each kernel sampler × prediction type, first/middle/last steps), NaN
model outputs, a learned-sigma `out[:, :C]` view. Device guards, where there is a second
device: the kernel, a fence and a whole EngineCore on cuda:N while another device is
current (the engine against CPU)."""
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
