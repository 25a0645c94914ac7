"""Layers that add each row's own adapters to a base Linear / Conv2d, without touching it.

`LoraLinear` and `LoraConv2d` subclass the layer they replace and hold the *same*
Parameter objects (no copy; state_dict keys, `isinstance(m, nn.Linear)` and
`m.weight` stay as they were), so the base weights are never modified and never fused.
Each call computes the base layer, then adds `Σ_k s[r,k] · B_a(A_a · x[r])` for every
row r with the adapters bound for this call.

The rows come from one `AdapterRows` shared by all wrapped layers of a model:
`DiffusionModel.run` calls `bind(lora_index, lora_scale)` before each denoiser call.
`bind(None, None)` (a call whose rows have no adapter: the runner leaves the adapter
fields out of such a call, so on CUDA it launches no LoRA kernel either) leaves nothing
bound and every wrapped layer is the base layer plus one attribute test.

Inside a CUDA-graph capture a Linear or 1×1 conv layer launches its kernels even while it
has no adapter (they read the pool's device tables when replayed, so the graph serves
whatever is loaded later); eagerly, such a layer skips them.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.lora.kernel import (DEFAULT_RANK_LIMIT, RowGroups, SlotWeights, add_lora_, add_lora_conv_reference,
                                capturing)


class AdapterRows:
    """The current call's per-row adapters, read by every wrapped layer of a model.

    `bind(index, scale)`: rows × K slots and scales for the call (None: no adapters).
    `bind_uniform(slots, scales)`: the same adapters for every row, however many rows a
    layer sees (the encode stage, where a model may batch a subset of the prompts)."""

    def __init__(self):
        self.current: RowGroups | None = None
        self._uniform: tuple[list[int], list[float]] | None = None
        self._uniform_groups: dict[int, RowGroups | None] = {}
        self._device = torch.device("cpu")

    def bind(self, index: torch.Tensor | None, scale: torch.Tensor | None) -> None:
        self._uniform = None
        if index is None:
            self.current = None
            return
        if scale is None:
            raise ValueError("lora_index given without lora_scale")
        self.current = RowGroups.build(index, scale)

    def bind_uniform(self, slots, scales, device: torch.device | str = "cpu") -> None:
        self.current, self._uniform, self._uniform_groups = None, (list(slots), list(scales)), {}
        self._device = torch.device(device)

    def for_rows(self, rows: int) -> RowGroups | None:
        """What a layer that sees `rows` rows applies (None: nothing)."""
        if self._uniform is None:
            return self.current
        groups = self._uniform_groups.get(rows, False)
        if groups is False:
            slots, scales = self._uniform
            index = torch.tensor([slots] * rows, dtype=torch.int32, device=self._device).reshape(rows, len(slots))
            scale = torch.tensor([scales] * rows, dtype=torch.float32, device=self._device).reshape(rows, len(slots))
            groups = self._uniform_groups[rows] = RowGroups.build(index, scale)
        return groups

    def clear(self) -> None:
        self.current, self._uniform, self._uniform_groups = None, None, {}


class _LoraLayer:
    """What both wrappers share: the slot weights, the rows, the layer's name in the model."""

    weights: SlotWeights
    adapter_rows: AdapterRows
    module_name: str

    def _adopt(self, base: nn.Module, capacity: int, adapter_rows: AdapterRows, module_name: str,
               kernel_size=(1, 1), rank_limit: int = DEFAULT_RANK_LIMIT) -> None:
        # the base's Parameter objects themselves: shared, never copied or modified
        self.register_parameter("weight", base.weight)
        self.register_parameter("bias", base.bias)
        self.__dict__["base_layer"] = base  # not a submodule: state_dict keys stay the base's
        self.adapter_rows, self.module_name = adapter_rows, module_name
        out_features, in_features = base.weight.shape[:2]
        self.weights = SlotWeights(capacity, in_features, out_features, base.weight.device, base.weight.dtype,
                                   kernel_size, rank_limit)

    def _idle(self, out: torch.Tensor) -> bool:
        """No adapter can reach this call's output: none resident here, and no capture that
        must serve the ones loaded later."""
        return self.weights.max_rank == 0 and not (self.weights.is_pointwise and capturing(out.device))


class LoraLinear(nn.Linear, _LoraLayer):
    """`base(x) + Σ_k s[r,k] · B_a(A_a · x[r])` for each row r (x: rows × ... × in)."""

    def __init__(self, base: nn.Linear, capacity: int, adapter_rows: AdapterRows, module_name: str = "",
                 rank_limit: int = DEFAULT_RANK_LIMIT):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self._adopt(base, capacity, adapter_rows, module_name, rank_limit=rank_limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if self._idle(out):
            return out
        groups = self.adapter_rows.for_rows(x.shape[0])
        if groups is None:
            return out
        if x.dim() == 3:  # rows × tokens × features: attention and feed-forward, as is
            add_lora_(out, x, self.weights, groups)
        else:
            rows = x.shape[0]
            add_lora_(out.view(rows, -1, self.out_features), x.reshape(rows, -1, self.in_features), self.weights,
                      groups)
        return out


_CONV_ATTRIBUTES = ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "transposed",
                    "output_padding", "groups", "padding_mode", "_reversed_padding_repeated_twice")


class LoraConv2d(nn.Conv2d, _LoraLayer):
    """The same for a Conv2d (groups 1): a 1×1 conv goes through the matmul path (the
    kernel on CUDA), whatever its stride and padding, a k×k conv (LoCon) through
    `add_lora_conv_reference`."""

    def __init__(self, base: nn.Conv2d, capacity: int, adapter_rows: AdapterRows, module_name: str = "",
                 rank_limit: int = DEFAULT_RANK_LIMIT):
        if base.groups != 1:
            raise ValueError(f"{module_name}: LoRA on a grouped conv (groups={base.groups}) is not supported")
        nn.Module.__init__(self)
        for name in _CONV_ATTRIBUTES:
            setattr(self, name, getattr(base, name))
        self.pointwise = tuple(base.kernel_size) == (1, 1)
        # a 1×1 kernel reads one pixel: "same" pads nothing, and dilation changes nothing
        pad = (0, 0) if isinstance(base.padding, str) else tuple(base.padding)
        self._pointwise_offset = (pad, tuple(base.stride))
        self._adopt(base, capacity, adapter_rows, module_name, tuple(base.kernel_size), rank_limit)

    def _pointwise_input(self, x: torch.Tensor) -> torch.Tensor:
        """The pixels a 1×1 conv of this stride and padding reads, one per output pixel:
        peft's lora_A is a 1×1 conv with the base's stride and zero padding (whatever the
        base's padding mode), so the padded border reads zeros and adds nothing."""
        (ph, pw), (sh, sw) = self._pointwise_offset
        if (ph, pw, sh, sw) == (0, 0, 1, 1):
            return x
        if ph or pw:
            x = F.pad(x, (pw, pw, ph, ph))
        return x[:, :, ::sh, ::sw]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._conv_forward(x, self.weight, self.bias)
        if self._idle(out):
            return out
        groups = self.adapter_rows.for_rows(x.shape[0])
        if groups is None:
            return out
        if self.pointwise:  # channels are features, pixels are tokens: strided views, no copy
            rows = x.shape[0]
            x = self._pointwise_input(x)
            # `view` (not flatten) for out: the add must land in `out` itself, never in a copy
            add_lora_(out.view(rows, self.out_channels, -1).transpose(1, 2),
                      x.reshape(rows, self.in_channels, -1).transpose(1, 2), self.weights, groups)
        else:
            add_lora_conv_reference(out, x, self.weights, groups, self.stride, self.padding, self.dilation)
        return out


LORA_LAYER_TYPES = (LoraLinear, LoraConv2d)


def wrap_layers(module: nn.Module, capacity: int, adapter_rows: AdapterRows,
                rank_limit: int = DEFAULT_RANK_LIMIT) -> dict[str, _LoraLayer]:
    """Replace every Linear and (ungrouped) Conv2d of `module` by its LoRA layer, taking
    adapters up to `rank_limit`; return them by module name. Already wrapped layers are
    kept (installing twice is a no-op)."""
    wrapped: dict[str, _LoraLayer] = {}
    by_identity: dict[int, nn.Module] = {}
    for name, child in list(module.named_modules(remove_duplicate=False)):
        if isinstance(child, LORA_LAYER_TYPES):
            wrapped[name] = child
            continue
        if id(child) in by_identity:  # one layer registered under two names: one wrapper
            new = by_identity[id(child)]
        elif type(child) is nn.Linear:
            new = LoraLinear(child, capacity, adapter_rows, name, rank_limit)
        elif type(child) is nn.Conv2d and child.groups == 1:
            new = LoraConv2d(child, capacity, adapter_rows, name, rank_limit)
        else:
            continue
        by_identity[id(child)] = new
        module.set_submodule(name, new)
        wrapped[name] = new
    return wrapped


def unwrap_layers(module: nn.Module) -> None:
    """Put the base layers back (the wrappers' adapters are dropped with them)."""
    for name, child in list(module.named_modules(remove_duplicate=False)):
        if isinstance(child, LORA_LAYER_TYPES):
            module.set_submodule(name, child.base_layer)
