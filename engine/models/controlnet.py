"""Per-row ControlNet inside one denoiser call: SD 1.x/2.x and SDXL
(`StableDiffusionControlNetPipeline`, `StableDiffusionXLControlNetPipeline`), FLUX and SD3
(below).

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
  (the negative prompt's row gets zero residuals, the pipeline's `torch.cat([zeros, d])`);
  a request whose first ControlNet pools its residuals (`global_pool_conditions`, the
  shuffle-style ones: 1 × 1 residuals the UNet broadcasts) runs in guess mode, as the
  pipeline's `guess_mode or global_pool_conditions`, with the plain scale for that one.

FLUX (`FluxControlNetPipeline`, a `FluxControlNetModel`): the control image is
VAE-encoded (sampled from the request's own generator before its initial noise, as the
pipeline draws) and packed; the ControlNet runs on the prompt's row only and its residuals
(`controlnet_block_samples`, `controlnet_single_block_samples`) go to both rows of a
true-CFG request, as the pipeline passes the same ones to its negative call.

SD3 (`StableDiffusion3ControlNetPipeline`, an `SD3ControlNetModel`): the control image is
VAE-encoded once per row of the request's call (both rows with classifier-free guidance,
each its own sample of one draw: the pipeline encodes `torch.cat([image] * 2)`), and the
ControlNet runs on both rows, its `controlnet_block_samples` given to the transformer as
`block_controlnet_hidden_states`. The pipeline draws those samples from torch's global
generator; the engine from one seeded with the request's seed (`control_generator`).
"""
from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np
import torch

from engine.models.model import to_device

#: the most controls one request may apply
MAX_CONTROLS = 8


#: the ControlNet class each served pipeline takes, and the config keys that must match its denoiser's
CONTROLNET_CLASSES = {
    "ControlNetModel": ("unet", ("in_channels", "block_out_channels", "layers_per_block", "cross_attention_dim",
                                 "addition_embed_type", "down_block_types")),
    "FluxControlNetModel": ("transformer", ("in_channels", "joint_attention_dim", "pooled_projection_dim",
                                            "guidance_embeds", "axes_dims_rope")),
    "SD3ControlNetModel": ("transformer", ("in_channels", "patch_size", "pooled_projection_dim")),
}


def check_controlnet(controlnet, model) -> str | None:
    """Why `controlnet` cannot run beside `model`'s denoiser, or None: its residuals must
    have the shapes the denoiser's blocks add them to."""
    kind = type(controlnet).__name__
    denoiser_name, keys = CONTROLNET_CLASSES.get(kind, (None, ()))
    pipe = getattr(model, "pipe", None)
    denoiser = getattr(pipe, denoiser_name, None) if denoiser_name else None
    if denoiser is None or getattr(model, "controlnet_class", None) != kind:
        return (f"a {kind} does not serve {model.pipeline_class or 'this model'} (SD 1.x/2.x and SDXL take a "
                "ControlNetModel, FLUX a FluxControlNetModel, SD3 an SD3ControlNetModel)")
    if kind == "FluxControlNetModel":
        if controlnet.union or controlnet.input_hint_block is not None:
            return "union and XLabs FLUX ControlNets are not served (an InstantX-style FluxControlNetModel is)"
        inner = controlnet.config.num_attention_heads * controlnet.config.attention_head_dim
        if inner != denoiser.config.num_attention_heads * denoiser.config.attention_head_dim:
            return f"its width {inner} is not the served transformer's"
    if kind == "SD3ControlNetModel":
        why = _check_sd3_controlnet(controlnet.config, denoiser.config)
        if why:
            return why
    theirs, ours = controlnet.config, denoiser.config
    for key in keys:
        if tuple(np.atleast_1d(theirs.get(key) or ())) != tuple(np.atleast_1d(ours.get(key) or ())):
            return f"its {key} {theirs.get(key)!r} is not the served {denoiser_name}'s {ours.get(key)!r}"
    return None


def _check_sd3_controlnet(theirs, ours) -> str | None:
    if theirs.extra_conditioning_channels:
        return ("an inpainting SD3 ControlNet (extra_conditioning_channels) is not served "
                "(StableDiffusion3ControlNetPipeline's ControlNets are)")
    inner = theirs.num_attention_heads * theirs.attention_head_dim
    if inner != ours.num_attention_heads * ours.attention_head_dim:
        return f"its width {inner} is not the served transformer's"
    if theirs.joint_attention_dim is not None and theirs.joint_attention_dim != ours.joint_attention_dim:
        return f"its joint_attention_dim {theirs.joint_attention_dim} is not the served transformer's"
    if (theirs.use_pos_embed and theirs.pos_embed_max_size and ours.pos_embed_max_size
            and theirs.pos_embed_max_size < ours.pos_embed_max_size):
        return (f"its positional embedding ({theirs.pos_embed_max_size} patches a side) covers less than the "
                f"served transformer's ({ours.pos_embed_max_size})")
    return None


def load_controlnet(model, path) -> torch.nn.Module:
    """The `ControlNetModel` saved in `path`, in the model's dtype on its device; ValueError
    saying what does not fit the served model."""
    path = pathlib.Path(path)
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(f"{path}: not a ControlNet folder (no config.json)")
    kind = json.loads(config.read_text()).get("_class_name")
    if kind not in CONTROLNET_CLASSES:
        raise ValueError(f"{path}: a {kind}, not one of {', '.join(CONTROLNET_CLASSES)}")
    import diffusers

    controlnet = getattr(diffusers, kind).from_pretrained(path, low_cpu_mem_usage=False, torch_dtype=model.dtype)
    why = check_controlnet(controlnet, model)
    if why:
        raise ValueError(f"{path}: {why}")
    if kind == "SD3ControlNetModel" and controlnet.config.use_pos_embed is False:
        # SD3.5's ControlNets take the transformer's positional embedding, as the pipeline gives it them
        controlnet.pos_embed = controlnet._get_pos_embed_from_transformer(model.pipe.transformer)
    return controlnet.to(model.device, model.dtype).eval().requires_grad_(False)


def attach_controlnets(model, paths: dict[str, str | pathlib.Path]) -> dict:
    """Load each `NAME=PATH` ControlNet and serve it beside `model` (`model.controlnets`)."""
    controlnets = dict(getattr(model, "controlnets", None) or {})
    for name, path in paths.items():
        controlnets[name] = load_controlnet(model, path)
    shapes = {residual_layout(net) for net in controlnets.values()}
    if len(shapes) > 1:  # several on one request are summed residual by residual
        raise ValueError(f"the ControlNets give different residual layouts ({sorted(shapes)}): they cannot be summed")
    settings = {name: multi_settings(net) for name, net in controlnets.items()}
    if len(set(settings.values())) > 1:
        raise ValueError("the SD3 ControlNets differ in force_zeros_for_pooled_projection or in taking the prompt "
                         f"(joint_attention_dim) ({settings}): diffusers' multi-ControlNet runs them all as its "
                         "first, so they cannot be summed")
    model.controlnets = controlnets
    return controlnets


def residual_layout(controlnet) -> tuple[int, ...]:
    """How many residuals of each kind the ControlNet gives: (down blocks + mid) for a
    UNet ControlNet, (double blocks, single blocks) for FLUX's, (blocks,) for SD3's."""
    if hasattr(controlnet, "controlnet_single_blocks"):
        return len(controlnet.controlnet_blocks), len(controlnet.controlnet_single_blocks)
    if hasattr(controlnet, "controlnet_down_blocks"):
        return (len(controlnet.controlnet_down_blocks) + 1,)
    return (len(controlnet.controlnet_blocks),)


def multi_settings(controlnet) -> tuple:
    """What SD3's multi-ControlNet pipeline reads from its first ControlNet and applies to
    all (zero pooled projections and unshifted control latents; the prompt given to them
    or not): ControlNets summed on one request must agree on it."""
    if type(controlnet).__name__ != "SD3ControlNetModel":
        return ()
    config = controlnet.config
    return bool(config.force_zeros_for_pooled_projection), config.joint_attention_dim is not None


def pools_conditions(controlnet) -> bool:
    """Whether the ControlNet's forward mean-pools its residuals (`global_pool_conditions`:
    the shuffle-style ControlNets)."""
    return bool(getattr(controlnet.config, "global_pool_conditions", False))


def request_guess_mode(guess_mode: bool, controlnets: list) -> bool:
    """The guess mode the SD/SDXL pipelines run a request in: asked for, or implied by its
    first ControlNet pooling its residuals (`guess_mode or global_pool_conditions`, read
    from the multi-ControlNet's first)."""
    return bool(guess_mode) or pools_conditions(controlnets[0])


def check_pooling_order(controlnets: list) -> str | None:
    """Why a request's ControlNets (in its order) cannot be summed as the multi-ControlNet
    sums them, or None: it adds each one's residuals into the first's in place, so a
    pooling ControlNet's 1 × 1 residuals cannot come before full-sized ones."""
    pooled = [pools_conditions(net) for net in controlnets]
    if pooled[0] and not all(pooled):
        k = pooled.index(False)
        return (f"{k}: a ControlNet that pools its residuals (global_pool_conditions) is first, this one does not "
                "pool: diffusers' multi-ControlNet cannot sum them in this order (put the pooling one after)")
    return None


def control_factors(scale: float, guess_mode: bool, controlnet) -> torch.Tensor:
    """The float32 factors the ControlNet's forward scales each of its residuals by,
    computed as it computes them: the scale, or in guess mode one per down residual and the
    mid residual's last (`logspace(-1, 0, blocks + 1) · scale`) — except for a ControlNet
    that pools its residuals, which keeps the plain scale in guess mode too."""
    count = sum(residual_layout(controlnet))
    if guess_mode and not pools_conditions(controlnet):
        return torch.logspace(-1, 0, count) * scale
    return torch.full((count,), scale, dtype=torch.float32)


@dataclasses.dataclass
class ControlEntry:
    """One control of one request, prepared: which ControlNet, its image as the ControlNet
    takes it (1 × 3 × H × W in its dtype; FLUX's and SD3's control latents, SD3's one per
    row), per step whether it applies (`keep`), and its per-block factors."""

    name: str
    image: torch.Tensor
    keep: np.ndarray  # bool, one per step of the request's schedule
    factors: torch.Tensor  # float32, blocks + 1

    def moved(self, move) -> "ControlEntry":
        return dataclasses.replace(self, image=move(self.image))

    def image_of(self, negative: bool) -> torch.Tensor:
        """Its control image for one row: the same for every row, or one per row of its
        request's call (SD3's control latents: the negative prompt's first)."""
        if self.image.shape[0] == 1:
            return self.image
        return self.image[:1] if negative else self.image[1:2]


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
    also: list[int] = dataclasses.field(default_factory=list)  # a second row each entry's residuals go to (-1: none)


class ControlCall:
    """The ControlNets of one denoiser call (see the module docstring)."""

    def __init__(self, runs: list[ControlRun], device: torch.device):
        self.runs, self.device = runs, device
        self._staged = None

    def index_select(self, dim: int, rows: torch.Tensor) -> "ControlCall | None":
        """The same controls for a subset of the call's rows (a call split in chunks)."""
        where = {row: k for k, row in enumerate(rows.tolist())}
        runs = []
        for run in self.runs:
            kept = [j for j, row in enumerate(run.rows) if row in where]
            if kept:
                also = [where.get(run.also[j], -1) if run.also else -1 for j in kept]
                runs.append(ControlRun(run.net, [where[run.rows[j]] for j in kept], [run.images[j] for j in kept],
                                       [run.factors[j] for j in kept], [run.positions[j] for j in kept], also))
        return ControlCall(runs, self.device) if runs else None

    def _stage(self):
        """Each run's device tensors: the rows, the images, the factors, and per position
        (entry indices, their rows)."""
        if self._staged is None:
            staged = []
            for run in self.runs:
                rows = np.asarray(run.rows, dtype=np.int64)
                also = np.asarray(run.also if run.also else [-1] * len(run.rows), dtype=np.int64)
                positions = np.asarray(run.positions)
                by_position = []
                for p in sorted(set(run.positions)):
                    for targets, picked in ((rows, np.flatnonzero(positions == p)),
                                            (also, np.flatnonzero((positions == p) & (also >= 0)))):
                        if picked.size:
                            by_position.append((p, to_device(torch.from_numpy(picked), self.device),
                                                to_device(torch.from_numpy(targets[picked]), self.device)))
                staged.append((to_device(torch.from_numpy(rows), self.device), torch.cat(run.images),
                               to_device(torch.stack(run.factors), self.device), by_position))
            self._staged = staged
        return self._staged

    def residuals(self, sample: torch.Tensor, timestep: torch.Tensor, hidden: torch.Tensor,
                  added: dict | None = None) -> dict:
        """The UNet's `down_block_additional_residuals` and `mid_block_additional_residual`
        for every row of the call (zeros for rows without a control at this step)."""
        def run(net, rows, images):
            kwargs = {}
            if added is not None:
                kwargs["added_cond_kwargs"] = {k: v.index_select(0, rows) for k, v in added.items()}
            down, mid = net(sample.index_select(0, rows), timestep.index_select(0, rows),
                            encoder_hidden_states=hidden.index_select(0, rows), controlnet_cond=images,
                            conditioning_scale=1.0, return_dict=False, **kwargs)
            return [*down, mid]

        total = self.summed(run, sample.shape[0])
        return {"down_block_additional_residuals": tuple(total[:-1]), "mid_block_additional_residual": total[-1]}

    def summed(self, run, n: int) -> list[torch.Tensor]:
        """Every residual of the call's ControlNets for all `n` rows: `run(net, rows, images)`
        gives a ControlNet's residuals (at scale 1) for its entries; each entry's are scaled
        by its factors and added into zeros in its request's order of controls."""
        outputs = []
        for control_run, (rows, images, factors, by_position) in zip(self.runs, self._stage()):
            produced = run(control_run.net, rows, images)
            # the factor in float32 (the forward's own arithmetic), the product in the residual's dtype
            scaled = [(r.float() * factors[:, k].view(-1, *([1] * (r.dim() - 1)))).to(r.dtype)
                      for k, r in enumerate(produced)]
            outputs.append((scaled, by_position))
        # a pooling ControlNet's residuals are 1 × 1: the denoiser broadcasts them, as a
        # multi-ControlNet's sum does beside a full-sized one
        shapes = [torch.broadcast_shapes(*(scaled[k].shape[1:] for scaled, _ in outputs))
                  for k in range(len(outputs[0][0]))]
        total = [torch.zeros((n, *shape), dtype=r.dtype, device=r.device) for shape, r in zip(shapes, outputs[0][0])]
        for p in sorted({p for _, by_position in outputs for p, _, _ in by_position}):
            for scaled, by_position in outputs:  # within a position every row appears once: one add each
                for q, picked, rows in by_position:
                    if q == p:
                        for acc, r in zip(total, scaled):
                            acc.index_add_(0, rows, r.index_select(0, picked).expand(-1, *acc.shape[1:]))
        return total


