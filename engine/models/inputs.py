"""The per-row model-input contract: everything one denoiser call takes, row by row.

The runner's row map gathers a `ModelInputs` from slot-owned state for every call; the
model's `run(inputs)` passes the fields to its denoiser by name (the shape of
diffusers' `added_cond_kwargs`). The eager path, the CUDA-graph path
(`engine.core.graphs`, which captures `run` on buffers of these very fields) and the
tests all use this one structure.

Two kinds of per-row input:

* prompt rows (`hidden`, `pooled`): per prompt, shared through the embedding cache
  (`hidden_mask` is derived per call from the rows' prompt lengths);
* request inputs (`time_ids`, `guidance`, `timestep_cond`, `lora_index`, `lora_scale`):
  per request and branch, prepared at admission (the model's `request_inputs`, the input
  kinds' rows) and held by the slot; they never go through the embedding cache.

Which model takes which (a field a model does not take stays None):

| field | SD | SDXL | SD3 | FLUX | class-cond. |
|---|---|---|---|---|---|
| sample, timestep | yes | yes | yes | yes | yes |
| hidden | CLIP | CLIP-L + CLIP-G | CLIP + T5 | T5 | class index |
| pooled | | CLIP-G | CLIP-L + CLIP-G | CLIP-L | |
| time_ids | | add_time_ids | | | |
| guidance | | | | dev (embedded) | |
| timestep_cond | LCM UNets | LCM UNets | | | |
| lora_index, lora_scale | adapters | adapters | adapters | adapters | |
| ip_embeds, ip_scale | IP-Adapter | IP-Adapter | | | |
| controls | ControlNets | ControlNets | | | |

Qwen-Image (`engine.models.qwen_image`) takes `hidden` (its Qwen2.5-VL encoder's last
hidden state, each prompt at its own length) with `hidden_mask` where a call's prompts
differ in length, and `guidance` if its transformer embeds it; Qwen-Image-Edit also
`image_latents`, the edited image's latents, the same for both branches of a request.

`controls` is not a tensor but the call's `engine.models.controlnet.ControlCall` (which
rows run which ControlNet, at their own steps); a call that has one runs eagerly.
"""
from __future__ import annotations

import dataclasses

import torch

@dataclasses.dataclass
class ModelInputs:
    """One denoiser call's inputs, one leading row per batch row."""

    sample: torch.Tensor  # rows × C × h × w, already scaled as the scheduler's scale_model_input
    timestep: torch.Tensor  # rows, float32, the schedule's own timestep values
    hidden: torch.Tensor  # rows × sequence × width (class-conditional: rows, the class index)
    pooled: torch.Tensor | None = None  # rows × width
    time_ids: torch.Tensor | None = None  # rows × 6: SDXL's micro-conditioning
    guidance: torch.Tensor | None = None  # rows: FLUX-dev's embedded (distilled) guidance scale
    timestep_cond: torch.Tensor | None = None  # rows × time_cond_proj_dim: LCM's guidance embedding
    lora_index: torch.Tensor | None = None  # rows × K int32: adapter slots in the pool, -1 none
    lora_scale: torch.Tensor | None = None  # rows × K float32: each adapter's scale
    # rows × sequence bool: a call whose rows' prompts differ in length (Qwen-Image) pads
    # `hidden` with zeros to its longest and marks each row's real tokens; None otherwise
    hidden_mask: torch.Tensor | None = None
    # rows × C × h' × w': Qwen-Image-Edit's input image latents, appended to each row's image
    # tokens (a request input: the image kind prepares it at admission)
    image_latents: torch.Tensor | None = None
    ip_embeds: torch.Tensor | None = None  # rows × 1 × width: IP-Adapter image embeddings (zeros: none)
    ip_scale: torch.Tensor | None = None  # rows × 1 float32: each row's IP-Adapter scale (0: none)
    controls: object | None = None  # the call's ControlCall: its rows' ControlNets (None: no row has one)

    def named(self) -> dict[str, torch.Tensor]:
        """The fields that are present, by name, in declaration order (a graph's buffers)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    def select(self, rows: torch.Tensor) -> "ModelInputs":
        """The same inputs for a subset of rows (index tensor on the inputs' device)."""
        return ModelInputs(**{name: value.index_select(0, rows) for name, value in self.named().items()})

    @property
    def rows(self) -> int:
        return int(self.sample.shape[0])
