"""The fused per-slot update: every active slot's solver step in one launch, in place.

For active entry j (see `engine.core.solvers` for the coefficient columns):

    slot, rc, ru, rn = index[j]                # slot, cond row, uncond row (-1: none), noise row (-1: none)
    out = M[rc]            if ru < 0
        = M[ru] + g * (M[rc] - M[ru])  otherwise  # diffusers' guidance combine, same rounding order
    x   = X[slot]
    x0u = p * x + q * out
    x0  = clamp(x0u, -clip, clip)
    X[slot] = a * x + e * out + b * x0 + ((x - m * x0u) / ks) * kt + hc * H[slot] + d * N[rn]
    H[slot] = x0                               if keep_history

`update_slots_reference` (torch) defines the function and is the CPU path;
`update_slots_triton` is the GPU kernel (tests run it through TRITON_INTERPRET=1).
Rows of M are flattened latents (R × numel); X and H are slot storage (S × numel).

The two compute the same float32 function, rounding for rounding:
- every operation is one float32 operation in the order written above (Python's
  left-to-right evaluation, which is diffusers' order): the kernel divides with
  `tl.math.div_rn` (IEEE round-to-nearest; a plain `/` compiles to an approximate
  division on NVIDIA) and is compiled with `enable_fp_fusion=False` (no FMA contraction,
  which would skip the rounding of each product);
- the clamp propagates NaN like torch.minimum/maximum (`tl.minimum`/`tl.maximum` compile
  to IEEE minNum/maxNum, which drop a NaN operand): a NaN model output stays NaN in the
  latents and in the history, so the core's non-finite check sees it;
- the history term is added only where `hc != 0` and the noise term only where the entry
  has a noise row, in both (diffusers' first-order steps have no history term at all);
- rows may be strided views (row stride ≠ numel, e.g. `out[:, :C]` of a learned-sigma
  output, flattened): each tensor's row stride is passed to the kernel; a tensor whose
  elements are not unit-strided is made contiguous (inputs) or updated through a
  contiguous copy (latents, history);
- on `cuda:N` the launch runs under `torch.cuda.device(latents.device)`, so it goes to
  that device's current stream whatever the process's current device is.
"""
from __future__ import annotations

import contextlib

import torch

from engine.core.solvers import A, B, CLIP, D, E, G, HC, KEEP_HIST, KS, KT, M, NUM_COEFS, P, Q

try:
    import triton
    import triton.language as tl
except ImportError:  # platforms without a triton wheel still run the CPU path
    triton = None

# index columns
SLOT, ROW_COND, ROW_UNCOND, ROW_NOISE = range(4)


def update_slots_reference(model_out: torch.Tensor, latents: torch.Tensor, history: torch.Tensor,
                           noise: torch.Tensor, index: torch.Tensor, coefs: torch.Tensor) -> None:
    """Torch reference of the fused update; same signature and meaning as the kernel."""
    if index.numel() == 0:
        return
    index = index.long()
    slots, rc, ru, rn = index.unbind(1)
    c = coefs.to(torch.float32)
    col = lambda k: c[:, k, None]  # noqa: E731 - a per-entry column broadcast over elements
    cond = model_out[rc].float()
    uncond = model_out[ru.clamp(min=0)].float()
    out = torch.where((ru >= 0)[:, None], uncond + col(G) * (cond - uncond), cond)
    x = latents[slots]
    x0u = col(P) * x + col(Q) * out
    x0 = torch.minimum(torch.maximum(x0u, -col(CLIP)), col(CLIP))
    x_new = col(A) * x + col(E) * out + col(B) * x0 + ((x - col(M) * x0u) / col(KS)) * col(KT)
    has_hist = c[:, HC] != 0
    if bool(has_hist.all()):
        x_new = x_new + col(HC) * history[slots]
    elif bool(has_hist.any()):  # as the kernel: no history term at all where hc == 0 (0 * NaN is NaN)
        x_new = torch.where(has_hist[:, None], x_new + col(HC) * history[slots], x_new)
    if noise.numel():
        has_noise = (rn >= 0)[:, None]
        x_new = torch.where(has_noise, x_new + col(D) * noise[rn.clamp(min=0)], x_new)
    latents[slots] = x_new
    keep = c[:, KEEP_HIST] != 0
    if bool(keep.any()):
        history[slots[keep]] = x0[keep]


if triton is not None:

    @triton.jit
    def _update_slots_kernel(out_ptr, x_ptr, h_ptr, noise_ptr, index_ptr, coef_ptr, numel,
                             out_stride, x_stride, h_stride, noise_stride,
                             NUM_COEFS: tl.constexpr, BLOCK: tl.constexpr):
        j = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        slot = tl.load(index_ptr + j * 4 + 0).to(tl.int64)
        rc = tl.load(index_ptr + j * 4 + 1).to(tl.int64)
        ru = tl.load(index_ptr + j * 4 + 2).to(tl.int64)
        rn = tl.load(index_ptr + j * 4 + 3).to(tl.int64)
        cbase = coef_ptr + j * NUM_COEFS
        g = tl.load(cbase + 0)
        p = tl.load(cbase + 1)
        q = tl.load(cbase + 2)
        clip = tl.load(cbase + 3)
        a = tl.load(cbase + 4)
        e = tl.load(cbase + 5)
        b = tl.load(cbase + 6)
        m = tl.load(cbase + 7)
        ks = tl.load(cbase + 8)
        kt = tl.load(cbase + 9)
        hc = tl.load(cbase + 10)
        d = tl.load(cbase + 11)
        keep = tl.load(cbase + 12)

        # Each line is one float32 operation per element, in the reference's order; the
        # launch disables FMA contraction, so every product is rounded as in torch.
        out = tl.load(out_ptr + rc * out_stride + offs, mask=mask, other=0.0).to(tl.float32)
        if ru >= 0:
            uncond = tl.load(out_ptr + ru * out_stride + offs, mask=mask, other=0.0).to(tl.float32)
            out = uncond + g * (out - uncond)
        x_ptrs = x_ptr + slot * x_stride + offs
        h_ptrs = h_ptr + slot * h_stride + offs
        x = tl.load(x_ptrs, mask=mask, other=0.0)
        x0u = p * x + q * out
        # clamp(x0u, -clip, clip) keeping NaN (tl.maximum/minimum would turn NaN into ±clip)
        x0 = tl.where(x0u != x0u, x0u, tl.minimum(tl.maximum(x0u, -clip), clip))
        x_new = a * x + e * out + b * x0 + tl.math.div_rn(x - m * x0u, ks) * kt
        if hc != 0.0:
            x_new += hc * tl.load(h_ptrs, mask=mask, other=0.0)
        if rn >= 0:
            x_new += d * tl.load(noise_ptr + rn * noise_stride + offs, mask=mask, other=0.0)
        tl.store(x_ptrs, x_new, mask=mask)
        if keep != 0.0:
            tl.store(h_ptrs, x0, mask=mask)


# Compile options of every launch: no FMA contraction (see the module docstring).
LAUNCH_OPTIONS = dict(enable_fp_fusion=False)


def _rows(t: torch.Tensor, name: str, numel: int) -> torch.Tensor:
    """A 2-D tensor whose rows the kernel can address as base + row * stride(0) + i."""
    if t.dim() != 2 or t.shape[1] != numel:
        raise ValueError(f"update_slots: {name} must be rows × {numel}, not {tuple(t.shape)}")
    if t.stride(1) != 1 and numel > 1:
        t = t.contiguous()
    return t


def update_slots_triton(model_out: torch.Tensor, latents: torch.Tensor, history: torch.Tensor,
                        noise: torch.Tensor, index: torch.Tensor, coefs: torch.Tensor, block: int = 1024) -> None:
    """The fused Triton kernel: one program per (active entry, block of elements).

    Every tensor is checked: 2-D rows of `numel` elements (model_out, noise: any row
    stride; a non-unit element stride is copied to a contiguous tensor), index int32
    entries × 4, coefs float32 entries × NUM_COEFS, all on latents' device."""
    entries = index.shape[0]
    if entries == 0:
        return
    if latents.dim() != 2 or history.shape != latents.shape:
        raise ValueError(f"update_slots: latents {tuple(latents.shape)} and history {tuple(history.shape)} "
                         "must be the same slots × numel")
    if latents.dtype != torch.float32 or history.dtype != torch.float32:
        raise ValueError("update_slots: latents and history must be float32")
    if index.dtype != torch.int32 or index.dim() != 2 or index.shape[1] != 4:
        raise ValueError(f"update_slots: index must be int32 entries × 4, not {index.dtype} {tuple(index.shape)}")
    if coefs.dtype != torch.float32 or tuple(coefs.shape) != (entries, NUM_COEFS):
        raise ValueError(f"update_slots: coefs must be float32 {entries} × {NUM_COEFS}, "
                         f"not {coefs.dtype} {tuple(coefs.shape)}")
    device = latents.device
    for name, t in (("model_out", model_out), ("history", history), ("noise", noise), ("index", index),
                    ("coefs", coefs)):
        if t.device != device and not (name == "noise" and t.numel() == 0):
            raise ValueError(f"update_slots: {name} is on {t.device}, latents on {device}")
    numel = latents.shape[1]
    model_out = _rows(model_out, "model_out", numel)
    noise = latents if noise.numel() == 0 else _rows(noise, "noise", numel)  # empty: never read (rn == -1)
    x, h = _rows(latents, "latents", numel), _rows(history, "history", numel)
    index, coefs = index.contiguous(), coefs.contiguous()
    block = min(block, triton.next_power_of_2(numel))
    grid = (entries, triton.cdiv(numel, block))
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _update_slots_kernel[grid](model_out, x, h, noise, index, coefs, numel,
                                   model_out.stride(0), x.stride(0), h.stride(0), noise.stride(0),
                                   NUM_COEFS=NUM_COEFS, BLOCK=block, **LAUNCH_OPTIONS)
    if x is not latents:  # element-strided slot storage: written through a contiguous copy
        latents.copy_(x)
    if h is not history:
        history.copy_(h)


def update_slots(model_out, latents, history, noise, index, coefs) -> None:
    """The CPU path is the torch reference; on CUDA the Triton kernel."""
    if latents.is_cuda and triton is not None:
        update_slots_triton(model_out, latents, history, noise, index, coefs)
    else:
        update_slots_reference(model_out, latents, history, noise, index, coefs)



# ---- inpainting: keep the known region ---------------------------------------------------
#
# After a step's update, for every slot j of the entries (4-channel inpainting, as
# StableDiffusionInpaintPipeline's loop does it):
#
#     slot = index[j]; a, b = coefs[j]          # add_noise coefficients at the next timestep
#     proper = a * I[slot] + b * N[slot]          # the image's latents noised to it ((1, 0) after the last step)
#     X[slot] = (1 - K[slot]) * proper + K[slot] * X[slot]
#
# I: the image's latents, N: the request's initial noise, K: the mask at latent resolution
# (1 = repaint), each broadcast over the channels into slot rows of numel elements. Every
# product and sum is one float32 operation in the pipeline's order, in both versions.

def blend_known_region_reference(latents: torch.Tensor, image_latents: torch.Tensor, noise: torch.Tensor,
                                 mask: torch.Tensor, index: torch.Tensor, coefs: torch.Tensor) -> None:
    """Torch reference of the masked blend; same signature and meaning as the kernel."""
    if index.numel() == 0:
        return
    slots = index.long()
    a, b = coefs[:, 0, None], coefs[:, 1, None]
    proper = a * image_latents[slots] + b * noise[slots]
    keep = mask[slots]
    latents[slots] = (1 - keep) * proper + keep * latents[slots]


if triton is not None:

    @triton.jit
    def _blend_known_region_kernel(x_ptr, image_ptr, noise_ptr, mask_ptr, index_ptr, coef_ptr, numel,
                                   x_stride, image_stride, noise_stride, mask_stride, BLOCK: tl.constexpr):
        j = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        valid = offs < numel
        slot = tl.load(index_ptr + j).to(tl.int64)
        a = tl.load(coef_ptr + j * 2 + 0)
        b = tl.load(coef_ptr + j * 2 + 1)
        image = tl.load(image_ptr + slot * image_stride + offs, mask=valid, other=0.0)
        noise = tl.load(noise_ptr + slot * noise_stride + offs, mask=valid, other=0.0)
        keep = tl.load(mask_ptr + slot * mask_stride + offs, mask=valid, other=0.0)
        x_ptrs = x_ptr + slot * x_stride + offs
        x = tl.load(x_ptrs, mask=valid, other=0.0)
        proper = a * image + b * noise
        tl.store(x_ptrs, (1.0 - keep) * proper + keep * x, mask=valid)


def blend_known_region_triton(latents: torch.Tensor, image_latents: torch.Tensor, noise: torch.Tensor,
                              mask: torch.Tensor, index: torch.Tensor, coefs: torch.Tensor,
                              block: int = 1024) -> None:
    """The masked blend as one Triton launch: one program per (entry, block of elements).
    Slot storage: float32 slots × numel (unit element stride); index int32 entries;
    coefs float32 entries × 2; all on latents' device."""
    entries = index.shape[0]
    if entries == 0:
        return
    numel = latents.shape[1]
    for name, t in (("latents", latents), ("image_latents", image_latents), ("noise", noise), ("mask", mask)):
        if t.dim() != 2 or t.shape[1] != numel or t.dtype != torch.float32 or t.stride(1) != 1:
            raise ValueError(f"blend_known_region: {name} must be float32 rows × {numel} with unit element "
                             f"stride, not {t.dtype} {tuple(t.shape)}")
        if t.device != latents.device:
            raise ValueError(f"blend_known_region: {name} is on {t.device}, latents on {latents.device}")
    if index.dtype != torch.int32 or index.dim() != 1:
        raise ValueError(f"blend_known_region: index must be int32 entries, not {index.dtype} {tuple(index.shape)}")
    if coefs.dtype != torch.float32 or tuple(coefs.shape) != (entries, 2):
        raise ValueError(f"blend_known_region: coefs must be float32 {entries} × 2, not {tuple(coefs.shape)}")
    index, coefs = index.contiguous(), coefs.contiguous()
    block = min(block, triton.next_power_of_2(numel))
    grid = (entries, triton.cdiv(numel, block))
    device = latents.device
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _blend_known_region_kernel[grid](latents, image_latents, noise, mask, index, coefs, numel,
                                         latents.stride(0), image_latents.stride(0), noise.stride(0),
                                         mask.stride(0), BLOCK=block, **LAUNCH_OPTIONS)


def blend_known_region(latents, image_latents, noise, mask, index, coefs) -> None:
    """The CPU path is the torch reference; on CUDA the Triton kernel."""
    if latents.is_cuda and triton is not None:
        blend_known_region_triton(latents, image_latents, noise, mask, index, coefs)
    else:
        blend_known_region_reference(latents, image_latents, noise, mask, index, coefs)
