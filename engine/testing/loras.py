"""LoRA adapters for tests and benchmarks, made offline with PEFT, and the oracle for a
request with adapters: the pipeline with diffusers' own `load_lora_weights(...,
adapter_name=...)` and `set_adapters(names, adapter_weights=scales)`."""
from __future__ import annotations

import copy
import functools
import pathlib

import numpy as np
import torch


def make_lora(pipe, name: str, seed: int, spec: dict, directory, weight_name: str | None = None) -> dict:
    """A random non-zero PEFT LoRA (`init_lora_weights=False`) for the pipeline's components
    (`spec`: component → LoraConfig arguments), saved as diffusers saves it, into
    `directory` (a folder holding pytorch_lora_weights.safetensors, or `weight_name` in
    it). Returns the PEFT-injected components (the adapter as trained)."""
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    torch.manual_seed(seed)
    kwargs, injected = {}, {}
    for component, config in spec.items():
        module = copy.deepcopy(getattr(pipe, component))
        lora_config = LoraConfig(init_lora_weights=False, **config)
        inject_adapter_in_model(lora_config, module, adapter_name=name)
        kwargs[f"{component}_lora_layers"] = get_peft_model_state_dict(module, adapter_name=name)
        kwargs[f"{component}_lora_adapter_metadata"] = lora_config.to_dict()
        injected[component] = module
    type(pipe).save_lora_weights(directory, weight_name=weight_name, **kwargs)
    return injected


def adapter_files(lora_dir) -> dict[str, tuple[pathlib.Path, str | None]]:
    """name → (directory, weight_name) of every adapter in `lora_dir`, as the pool names them."""
    lora_dir = pathlib.Path(lora_dir)
    found = {}
    for path in sorted(lora_dir.iterdir()):
        if path.is_dir() and (path / "pytorch_lora_weights.safetensors").exists():
            found[path.name] = (path, None)
        elif path.suffix == ".safetensors":
            found[path.stem] = (lora_dir, path.name)
    return found


@functools.lru_cache(maxsize=4)
def lora_pipeline(folder: str, lora_dir: str):
    """The folder's pipeline (its own copy) with every adapter of `lora_dir` loaded by diffusers."""
    import diffusers

    from engine.models.geometry import pipeline_class_of

    pipe = getattr(diffusers, pipeline_class_of(pathlib.Path(folder))).from_pretrained(folder,
                                                                                       low_cpu_mem_usage=False)
    pipe.set_progress_bar_config(disable=True)
    for name, (directory, weight_name) in adapter_files(lora_dir).items():
        pipe.load_lora_weights(directory, weight_name=weight_name, adapter_name=name)
    return pipe


@torch.no_grad()
def lora_pipeline_output(folder, lora_dir, params) -> np.ndarray:
    """The pipeline's `output_type="latent"` result for `params` (a `GenerateParams`) with
    its `loras` set as diffusers sets them (none: LoRA disabled)."""
    from engine.core.solvers import make_scheduler

    pipe = lora_pipeline(str(folder), str(lora_dir))
    if params.loras:
        pipe.enable_lora()
        pipe.set_adapters(list(params.loras), adapter_weights=list(params.loras.values()))
    else:
        pipe.disable_lora()
    original = pipe.scheduler
    if params.sampler != "default":
        pipe.scheduler = make_scheduler(params.sampler, dict(original.config, _class_name=type(original).__name__))
    else:
        pipe.scheduler = type(original).from_config(original.config)
    try:
        out = pipe(params.prompt, negative_prompt=params.negative_prompt, num_inference_steps=params.steps,
                   guidance_scale=params.guidance, height=params.height, width=params.width,
                   generator=torch.Generator("cpu").manual_seed(params.seed), output_type="latent")
    finally:
        pipe.scheduler = original
    return out.images[0].float().cpu().numpy()
