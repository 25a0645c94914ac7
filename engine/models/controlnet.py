"""Per-row ControlNet inside one denoiser call: SD 1.x/2.x and SDXL
(`StableDiffusionControlNetPipeline`, `StableDiffusionXLControlNetPipeline`).

The ControlNets are named at start (`--controlnet NAME=PATH`: a diffusers
`ControlNetModel` folder) and checked against the served UNet. A request names any
of them (`GenerateParams.controls`); its slot keeps each control image prepared as the
pipeline's `prepare_image` prepares it (`engine.core.input_kinds.controls`).

Each call the row map gathers a `ControlCall` from the slots' state: one `ControlRun`
per ControlNet some row uses at this step. A ControlNet runs once, on the gathered
sub-batch of its entries (an entry: a row, one of its request's controls); rows without
it pay nothing. Its residuals come back scaled per entry and are added into zero
residuals of the whole batch, entry by entry in each request's own order of controls, so
a request with several sums them as `MultiControlNetModel` does (0 + A + B, bit for bit).
The UNet then adds them (zeros for plain rows: their output is bit for bit a plain call's).

What the pipeline decides per step, decided here per row at its own step:

- the window: `controlnet_keep` — an entry runs only at steps i (of n) where
  neither i / n < start nor (i + 1) / n > end (outside, the pipeline's residuals are
  scaled by 0: skipping them changes nothing);
- the scale: the ControlNet runs with `conditioning_scale=1` and each entry's residuals
  are multiplied by the very float32 factors the ControlNet's forward would use (the
  scale, or in guess mode `logspace(-1, 0, blocks + 1) · scale` per block);
- guess mode: with classifier-free guidance only the prompt's row gets the ControlNet
  (the negative prompt's row gets zero residuals, the pipeline's `torch.cat([zeros, d])`).
"""
from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np
import torch

from engine.models.loading import to_device

#: the most controls one request may apply
MAX_CONTROLS = 8


def check_controlnet(controlnet, model) -> str | None:
    """Why `controlnet` cannot run beside `model`'s UNet, or None: its residuals must have
    the shapes the UNet's down and mid blocks add them to."""
    unet = getattr(model, "pipe", None) and getattr(model.pipe, "unet", None)
    if unet is None:
        return f"{model.pipeline_class or 'this model'} has no ControlNet path here (SD 1.x/2.x and SDXL UNets)"
    theirs, ours = controlnet.config, unet.config
    for key in ("in_channels", "block_out_channels", "layers_per_block", "cross_attention_dim",
                "addition_embed_type", "down_block_types"):
        if tuple(np.atleast_1d(theirs.get(key) or ())) != tuple(np.atleast_1d(ours.get(key) or ())):
            return f"its {key} {theirs.get(key)!r} is not the served UNet's {ours.get(key)!r}"
    return None


def load_controlnet(model, path) -> torch.nn.Module:
    """The `ControlNetModel` saved in `path`, in the model's dtype on its device; ValueError
    saying what does not fit the served model."""
    from diffusers import ControlNetModel

    path = pathlib.Path(path)
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(f"{path}: not a ControlNet folder (no config.json)")
    kind = json.loads(config.read_text()).get("_class_name")
    if kind != "ControlNetModel":
        raise ValueError(f"{path}: a {kind}, not a ControlNetModel (SD 1.x/2.x and SDXL ControlNets are served)")
    controlnet = ControlNetModel.from_pretrained(path, low_cpu_mem_usage=False, torch_dtype=model.dtype)
    why = check_controlnet(controlnet, model)
    if why:
        raise ValueError(f"{path}: {why}")
    return controlnet.to(model.device, model.dtype).eval().requires_grad_(False)


def attach_controlnets(model, paths: dict[str, str | pathlib.Path]) -> dict:
    """Load each `NAME=PATH` ControlNet and serve it beside `model` (`model.controlnets`)."""
    controlnets = dict(getattr(model, "controlnets", None) or {})
    for name, path in paths.items():
        controlnets[name] = load_controlnet(model, path)
    model.controlnets = controlnets
    return controlnets


def control_factors(scale: float, guess_mode: bool, blocks: int) -> torch.Tensor:
    """The float32 factors the ControlNet's forward scales its down residuals (one each)
    and its mid residual (the last) by, computed as it computes them."""
    if guess_mode:
        return torch.logspace(-1, 0, blocks + 1) * scale
    return torch.full((blocks + 1,), scale, dtype=torch.float32)


@dataclasses.dataclass
class ControlEntry:
    """One control of one request, prepared: which ControlNet, its image as the ControlNet
    takes it (1 × 3 × H × W in its dtype), per step whether it applies (`keep`), and its
    per-block factors."""

    name: str
    image: torch.Tensor
    keep: np.ndarray  # bool, one per step of the request's schedule
    factors: torch.Tensor  # float32, blocks + 1

    def moved(self, move) -> "ControlEntry":
        return dataclasses.replace(self, image=move(self.image))


@dataclasses.dataclass
class ControlRun:
    """One ControlNet's work in one call: its entries' rows of the call, their control
    images and factors; and, per position in a request's list of controls, which of its
    entries are there (host) — the order they are summed in."""

    net: torch.nn.Module
    rows: list[int]
    images: list[torch.Tensor]
    factors: list[torch.Tensor]
    positions: list[int]


class ControlCall:
    """The ControlNets of one denoiser call (see the module docstring)."""

    def __init__(self, runs: list[ControlRun], device: torch.device):
        self.runs, self.device = runs, device
        self._staged = None

    @property
    def entries(self) -> int:
        return sum(len(run.rows) for run in self.runs)

    def index_select(self, dim: int, rows: torch.Tensor) -> "ControlCall | None":
        """The same controls for a subset of the call's rows (a call split in chunks)."""
        where = {row: k for k, row in enumerate(rows.tolist())}
        runs = []
        for run in self.runs:
            kept = [j for j, row in enumerate(run.rows) if row in where]
            if kept:
                runs.append(ControlRun(run.net, [where[run.rows[j]] for j in kept], [run.images[j] for j in kept],
                                       [run.factors[j] for j in kept], [run.positions[j] for j in kept]))
        return ControlCall(runs, self.device) if runs else None

    def _stage(self):
        """Each run's device tensors: the rows, the images, the factors, and per position
        (entry indices, their rows)."""
        if self._staged is None:
            staged = []
            for run in self.runs:
                rows = np.asarray(run.rows, dtype=np.int64)
                positions = np.asarray(run.positions)
                by_position = []
                for p in sorted(set(run.positions)):
                    picked = np.flatnonzero(positions == p)
                    by_position.append((p, to_device(torch.from_numpy(picked), self.device),
                                        to_device(torch.from_numpy(rows[picked]), self.device)))
                staged.append((to_device(torch.from_numpy(rows), self.device), torch.cat(run.images),
                               to_device(torch.stack(run.factors), self.device), by_position))
            self._staged = staged
        return self._staged

    def residuals(self, sample: torch.Tensor, timestep: torch.Tensor, hidden: torch.Tensor,
                  added: dict | None = None) -> dict:
        """The UNet's `down_block_additional_residuals` and `mid_block_additional_residual`
        for every row of the call (zeros for rows without a control at this step)."""
        outputs = []
        for run, (rows, images, factors, by_position) in zip(self.runs, self._stage()):
            kwargs = {}
            if added is not None:
                kwargs["added_cond_kwargs"] = {k: v.index_select(0, rows) for k, v in added.items()}
            down, mid = run.net(sample.index_select(0, rows), timestep.index_select(0, rows),
                                encoder_hidden_states=hidden.index_select(0, rows), controlnet_cond=images,
                                conditioning_scale=1.0, return_dict=False, **kwargs)
            # the factor in float32 (the forward's own arithmetic), the product in the residual's dtype
            scaled = [(r.float() * factors[:, k].view(-1, *([1] * (r.dim() - 1)))).to(r.dtype)
                      for k, r in enumerate((*down, mid))]
            outputs.append((scaled, by_position))
        n = sample.shape[0]
        first = outputs[0][0]
        total = [torch.zeros((n, *r.shape[1:]), dtype=r.dtype, device=r.device) for r in first]
        for p in sorted({p for _, by_position in outputs for p, _, _ in by_position}):
            for scaled, by_position in outputs:  # within a position every row appears once: one add each
                for q, picked, rows in by_position:
                    if q == p:
                        for acc, r in zip(total, scaled):
                            acc.index_add_(0, rows, r.index_select(0, picked))
        return {"down_block_additional_residuals": tuple(total[:-1]), "mid_block_additional_residual": total[-1]}


def down_blocks(controlnet) -> int:
    """How many down residuals the ControlNet gives (one per `controlnet_down_blocks`)."""
    return len(controlnet.controlnet_down_blocks)
