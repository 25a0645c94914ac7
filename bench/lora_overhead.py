"""The LoRA path's overhead over a base denoiser call, on CPU through the torch reference
(the target: ≤ 25% at rank 8), on the embedded `shapes` model.

    python bench/lora_overhead.py [--rows 8] [--threads 1] [--rank 8] [--targets to_q,to_k,to_v,to_out.0]

Four random rank-r adapters (PEFT, `init_lora_weights=False`) are written to a temporary
folder and served by an `AdapterPool`; the calls are timed interleaved (one of each per
round, so machine noise hits them alike) and each is reported at its 10th percentile:
the base UNet (no wrappers), the wrapped UNet with nothing bound, one adapter for all
rows, one of four adapters per row, and two adapters per row.
"""
from __future__ import annotations

import argparse
import copy
import pathlib
import tempfile
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--targets", default="to_q,to_k,to_v,to_out.0")
    args = parser.parse_args()

    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    from engine.lora import AdapterPool
    from engine.lora.layers import unwrap_layers
    from engine.models import resolve
    from engine.models.loading import load_model

    torch.set_num_threads(args.threads)
    lora_dir = pathlib.Path(tempfile.mkdtemp(prefix="diffslot-lora-"))
    pipe = StableDiffusionPipeline.from_pretrained(resolve("shapes"))
    for i in range(4):
        torch.manual_seed(i)
        config = LoraConfig(r=args.rank, lora_alpha=args.rank, target_modules=args.targets.split(","),
                            init_lora_weights=False)
        unet = copy.deepcopy(pipe.unet)
        inject_adapter_in_model(config, unet, adapter_name=f"a{i}")
        StableDiffusionPipeline.save_lora_weights(
            lora_dir / f"a{i}", unet_lora_layers=get_peft_model_state_dict(unet, adapter_name=f"a{i}"))

    model = load_model("shapes")
    plain = copy.deepcopy(model.pipe.unet)
    pool = AdapterPool(model, lora_dir, budget_bytes=1 << 30)
    unwrap_layers(plain)
    slots = pool.acquire_waiting([f"a{i}" for i in range(4)])
    rows = args.rows
    channels, h, w = model.latent_shape(model.native_size, model.native_size)
    x, t = torch.randn(rows, channels, h, w), torch.full((rows,), 500.0)
    cond = model.encode(["a red circle"] * rows)
    hidden = torch.stack([c.hidden for c in cond])
    k = pool.max_per_request
    one = torch.full((rows, k), -1, dtype=torch.int32)
    one[:, 0] = slots[0]
    four = one.clone()
    four[:, 0] = torch.tensor([slots[r % 4] for r in range(rows)])
    two = four.clone()
    two[:, 1] = torch.tensor([slots[(r + 1) % 4] for r in range(rows)])
    scale = torch.zeros(rows, k)
    scale[:, :2] = 0.75
    calls = {
        "base (no wrappers)": lambda: plain(x, t, encoder_hidden_states=hidden).sample,
        "wrapped, nothing bound": lambda: model.denoise(x, t, cond),
        "1 adapter, all rows": lambda: model.denoise(x, t, cond, lora_index=one, lora_scale=scale),
        "1 of 4 adapters a row": lambda: model.denoise(x, t, cond, lora_index=four, lora_scale=scale),
        "2 adapters a row": lambda: model.denoise(x, t, cond, lora_index=two, lora_scale=scale),
    }
    times = {name: [] for name in calls}
    with torch.no_grad():
        for call in calls.values():
            for _ in range(3):
                call()
        for _ in range(args.rounds):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
    low = {name: sorted(v)[len(v) // 10] for name, v in times.items()}
    base = low["base (no wrappers)"]
    print(f"shapes UNet, latents {channels}×{h}×{w}, {rows} rows, rank {args.rank}, {args.threads} thread(s), "
          f"targets {args.targets} ({sum(1 for m in model.pipe.unet.modules() if getattr(m, 'weights', None) is not None and m.weights.max_rank)} layers)")
    for name, seconds in low.items():
        print(f"  {name:24s} {seconds * 1e3:7.2f} ms  {100 * (seconds / base - 1):+6.1f}%")


if __name__ == "__main__":
    main()
