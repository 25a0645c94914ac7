"""Loading a diffusers-format model folder: UNet, VAE, scheduler config, conditions."""
from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np
import torch
from diffusers import AutoencoderKL, UNet2DModel

from engine.models import resolve


def prediction_type_of(scheduler_config: dict) -> str:
    """The model's prediction type, in the contract's words: epsilon, v_prediction,
    sample or flow (a flow-matching scheduler config, or `flow_prediction`)."""
    if scheduler_config.get("_class_name", "").startswith("FlowMatch"):
        return "flow"
    pred = scheduler_config.get("prediction_type", "epsilon")
    return {"flow_prediction": "flow", "original_sample": "sample"}.get(pred, pred)


@dataclasses.dataclass
class LoadedModel:
    path: pathlib.Path
    unet: torch.nn.Module
    vae: AutoencoderKL | None
    scheduler_config: dict
    conditions: list[str]  # class-index order, the null condition last
    device: torch.device
    dtype: torch.dtype = torch.float32

    @property
    def null_index(self) -> int:
        return len(self.conditions) - 1

    @property
    def prediction_type(self) -> str:
        return prediction_type_of(self.scheduler_config)

    @property
    def revision(self) -> str:
        return str(self.path)

    @property
    def latent_channels(self) -> int:
        return int(self.unet.config.in_channels)

    @property
    def vae_scale(self) -> int:
        """Pixels per latent cell along one side."""
        if self.vae is None:
            return 1
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def native_size(self) -> int:
        return int(self.unet.config.sample_size) * self.vae_scale

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        return (self.latent_channels, height // self.vae_scale, width // self.vae_scale)

    def condition_index(self, condition: str) -> int:
        return self.conditions.index(condition)

    def denoise(self, x: torch.Tensor, t: torch.Tensor, class_labels: torch.Tensor) -> torch.Tensor:
        """One batched denoiser call: rows of latents, per-row timesteps and classes."""
        return self.unet(x, t, class_labels=class_labels).sample

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Final latents (B×C×h×w, unscaled as the denoiser sees them) → uint8 B×H×W×3."""
        images = self.vae.decode(latents.to(self.device, self.dtype) / self.vae.config.scaling_factor).sample
        images = ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        return images.permute(0, 2, 3, 1).cpu().numpy()


def load_model(name_or_path: str | pathlib.Path = "shapes", device: str | torch.device = "cpu",
               load_vae: bool = True) -> LoadedModel:
    path = resolve(name_or_path)
    device = torch.device(device)
    unet = UNet2DModel.from_pretrained(path / "unet", low_cpu_mem_usage=False).to(device).eval().requires_grad_(False)
    vae = None
    if load_vae:
        vae = AutoencoderKL.from_pretrained(path / "vae", low_cpu_mem_usage=False).to(device).eval().requires_grad_(False)
    scheduler_config = json.loads((path / "scheduler" / "scheduler_config.json").read_text())
    conditions = json.loads((path / "conditions.json").read_text())
    return LoadedModel(path=path, unet=unet, vae=vae, scheduler_config=scheduler_config,
                       conditions=conditions, device=device)
