"""Reading a diffusers-format LoRA file into per-layer low-rank factors, as diffusers reads
it: the pipeline class's `lora_state_dict` (kohya / A1111 keys converted as
`load_lora_weights` converts them), then the steps of `PeftAdapterMixin.load_lora_adapter`
(denoiser) and `_load_lora_into_text_encoder` (text encoders): prefix, conversion to peft
keys, the rank dict and `_create_lora_config`. Each module's scaling is peft's:
`lora_alpha / r` (rslora: `/ sqrt(r)`), r and alpha from the config's rank and alpha
patterns matched by peft's own `get_pattern_key`. What peft would load but the pool's
layers cannot serve (DoRA, LoRA biases, LoKr, embedding LoRA, grouped convs, a module the
model lacks, shapes that do not fit, a rank above the limit) is an `AdapterError` naming
the reason, never a path of the server.
"""
from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Callable

import torch

from engine.lora.layers import LoraConv2d


class AdapterError(ValueError):
    """An adapter that cannot be served (the reason is the message)."""


@dataclasses.dataclass
class Factors:
    """One targeted module of one adapter: its low-rank factors and peft's scaling."""

    component: str
    module: str
    A: torch.Tensor  # rank × in (conv: rank × in × kh × kw)
    B: torch.Tensor  # out × rank
    scaling: float


def file_signature(path: pathlib.Path) -> tuple:
    st = path.stat()
    return (st.st_mtime_ns, st.st_size)


def strip_prefix(mapping, prefix: str):
    if mapping is None:
        return None
    return {k.removeprefix(f"{prefix}."): v for k, v in mapping.items() if k.startswith(f"{prefix}.")}


class AdapterReader:
    """Reads adapter files for one pipeline's LoRA-loadable `components` (denoiser first),
    checked against the pool's wrapped `layers` (component → module name → layer; filled
    when the pool installs)."""

    def __init__(self, loader, components: dict[str, torch.nn.Module], layers: dict[str, dict], max_rank: int,
                 pipeline_class: str, inside: Callable[[pathlib.Path], bool]):
        self.loader, self.components, self.layers = loader, components, layers
        self.max_rank, self.pipeline_class, self.inside = max_rank, pipeline_class, inside
        self.denoiser_name = next(n for n in components if not n.startswith("text_encoder"))

    def device_bytes(self, f: Factors) -> int:
        layer = self.layers[f.component][f.module]
        size = torch.empty((), dtype=layer.weights.dtype).element_size()
        return (f.A.numel() + f.B.numel()) * size

    def read(self, path: pathlib.Path) -> list[Factors]:
        if not self.inside(path):  # replaced by a link out of the folder since it was listed
            raise AdapterError("its file is no longer in the adapter folder")
        kwargs = dict(weight_name=path.name, use_safetensors=True, local_files_only=True, return_lora_metadata=True)
        if self.denoiser_name == "unet":
            kwargs["unet_config"] = self.components["unet"].config  # SDXL maps kohya's SGM blocks with it
        # FLUX's loader returns alphas only when asked; the others ignore the keyword
        kwargs["return_alphas"] = True
        read = self.loader.lora_state_dict(str(path.parent), **kwargs)
        # (state dict, network alphas, metadata) for SD / SDXL / FLUX, (state dict, metadata) for SD3
        state_dict, network_alphas, metadata = read if len(read) == 3 else (read[0], None, read[1])
        if not all("lora" in key for key in state_dict):
            raise AdapterError("not a LoRA checkpoint (keys without 'lora', as load_lora_weights refuses)")
        factors: list[Factors] = []
        for component in self.components:
            factors += self._component_factors(component, state_dict, network_alphas, metadata)
        known_prefixes = tuple(f"{c}." for c in self.components)
        stray = sorted({k.split(".")[0] for k in state_dict if not k.startswith(known_prefixes)})
        if stray:
            raise AdapterError(f"holds weights for {', '.join(stray)}, which this "
                               f"{self.pipeline_class} does not have (it has {', '.join(self.components)})")
        if not factors:
            raise AdapterError("targets no layer of this model")
        return factors

    def _component_factors(self, component: str, state_dict, network_alphas, metadata) -> list[Factors]:
        from diffusers.utils.peft_utils import _create_lora_config

        module = self.components[component]
        sd = strip_prefix(state_dict, component)
        if not sd:
            return []
        # metadata for another component only: derive this one's config from its weights
        # (diffusers would build a default LoraConfig from {} and fail on the ranks)
        meta = strip_prefix(metadata, component) or None
        if any(".lokr_" in k for k in sd):
            raise AdapterError(f"{component}: a LoKr adapter, not LoRA")
        if component.startswith("text_encoder"):  # as diffusers' _load_lora_into_text_encoder
            from diffusers.utils import convert_state_dict_to_diffusers, convert_state_dict_to_peft

            sd = convert_state_dict_to_peft(convert_state_dict_to_diffusers(sd))
            if not hasattr(module, "text_model"):
                sd = {k.removeprefix("text_model."): v for k, v in sd.items()}
            rank = {}
            for name, _ in module.named_modules():
                if name.endswith((".q_proj", ".k_proj", ".v_proj", ".out_proj", ".fc1", ".fc2")):
                    key = f"{name}.lora_B.weight"
                    if key in sd:
                        rank[key] = sd[key].shape[1]
            alphas = None if network_alphas is None else {
                k.removeprefix(f"{component}."): v for k, v in network_alphas.items()
                if k.startswith(component) and k.split(".")[0] == component}
            is_unet = False
        else:  # as PeftAdapterMixin.load_lora_adapter
            from diffusers.utils import convert_unet_state_dict_to_peft

            if "lora_A" not in next(iter(sd)):
                sd = convert_unet_state_dict_to_peft(sd)
            if "lora_controlnet" in sd:
                raise AdapterError(f"{component}: a control LoRA (it replaces layers), not served")
            rank = {f"^{k}": v.shape[1] for k, v in sd.items() if "lora_B" in k and v.ndim > 1}
            alphas = strip_prefix(network_alphas, component) if network_alphas else network_alphas
            is_unet = True
        if network_alphas and meta:
            raise AdapterError("has both network alphas and adapter metadata (diffusers refuses it)")
        if not rank:
            raise AdapterError(f"{component}: no lora_B weights of a layer diffusers loads LoRA into")
        config = _create_lora_config(sd, alphas, meta, rank, is_unet=is_unet,
                                     model_state_dict=None if not is_unet else module.state_dict())
        return self._factors_of(component, module, sd, config)

    def _factors_of(self, component: str, module: torch.nn.Module, sd: dict, config) -> list[Factors]:
        from peft.utils.other import get_pattern_key

        if config.use_dora:
            raise AdapterError(f"{component}: a DoRA adapter (magnitude vectors): not served")
        if getattr(config, "lora_bias", False):
            raise AdapterError(f"{component}: a LoRA with lora_B biases: not served")
        layers = self.layers[component]
        targets: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in sd.items():
            target, sep, rest = key.partition(".lora_")
            if not sep or rest not in ("A.weight", "B.weight"):
                raise AdapterError(f"{component}: weight {key!r} is not a LoRA A/B matrix (only plain LoRA "
                                   "on Linear and Conv2d layers is served)")
            targets.setdefault(target, {})[rest[0]] = value
        out = []
        for target, ab in sorted(targets.items()):
            if set(ab) != {"A", "B"}:
                raise AdapterError(f"{component}: {target} has lora_{'A' if 'A' in ab else 'B'} only")
            layer = layers.get(target)
            if layer is None:
                try:
                    found = module.get_submodule(target)
                except AttributeError:
                    raise AdapterError(f"targets {component} module {target!r}, which this model lacks") from None
                raise AdapterError(f"targets {component}.{target}, a {type(found).__name__}: LoRA is served on "
                                   "Linear and (ungrouped) Conv2d layers only")
            A, B = ab["A"], ab["B"]
            r = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), target), config.r)
            if int(A.shape[0]) > self.max_rank:
                raise AdapterError(f"{component}.{target} has rank {int(A.shape[0])}; this engine serves ranks up "
                                   f"to {self.max_rank}")
            alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), target), config.lora_alpha)
            w = layer.weights
            if isinstance(layer, LoraConv2d):
                want_a, want_b = (r, w.in_features, *w.kernel_size), (w.out_features, r, 1, 1)
            else:
                want_a, want_b = (r, w.in_features), (w.out_features, r)
            if tuple(A.shape) != want_a or tuple(B.shape) != want_b:
                raise AdapterError(f"{component}.{target}: LoRA shapes A {tuple(A.shape)} B {tuple(B.shape)} do not "
                                   f"fit the layer (rank {r}: A {want_a}, B {want_b})")
            scaling = alpha / math.sqrt(r) if config.use_rslora else alpha / r
            out.append(Factors(component, target, A, B.reshape(B.shape[0], r), float(scaling)))
        return out
