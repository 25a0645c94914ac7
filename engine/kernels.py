"""The fused per-slot update: every active slot's solver step in one launch, in place.

For active entry j (see `engine.solvers` for the coefficient columns):

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
"""
from __future__ import annotations

import torch

from engine.solvers import A, B, CLIP, D, E, G, HC, KEEP_HIST, KS, KT, M, NUM_COEFS, P, Q

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
    x_new = x_new + col(HC) * history[slots]
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

        out = tl.load(out_ptr + rc * numel + offs, mask=mask, other=0.0).to(tl.float32)
        if ru >= 0:
            uncond = tl.load(out_ptr + ru * numel + offs, mask=mask, other=0.0).to(tl.float32)
            out = uncond + g * (out - uncond)
        x_ptrs = x_ptr + slot * numel + offs
        h_ptrs = h_ptr + slot * numel + offs
        x = tl.load(x_ptrs, mask=mask, other=0.0)
        x0u = p * x + q * out
        x0 = tl.minimum(tl.maximum(x0u, -clip), clip)
        x_new = a * x + e * out + b * x0 + ((x - m * x0u) / ks) * kt
        if hc != 0.0:
            x_new += hc * tl.load(h_ptrs, mask=mask, other=0.0)
        if rn >= 0:
            x_new += d * tl.load(noise_ptr + rn * numel + offs, mask=mask, other=0.0)
        tl.store(x_ptrs, x_new, mask=mask)
        if keep != 0.0:
            tl.store(h_ptrs, x0, mask=mask)


def update_slots_triton(model_out: torch.Tensor, latents: torch.Tensor, history: torch.Tensor,
                        noise: torch.Tensor, index: torch.Tensor, coefs: torch.Tensor, block: int = 1024) -> None:
    """The fused Triton kernel: one program per (active entry, block of elements)."""
    entries = index.shape[0]
    if entries == 0:
        return
    numel = latents.shape[1]
    assert model_out.shape[1] == numel and history.shape == latents.shape, "row sizes differ"
    assert index.dtype == torch.int32 and coefs.dtype == torch.float32 and coefs.shape[1] == NUM_COEFS
    if noise.numel() == 0:
        noise = latents  # never read: every noise row index is -1
    block = min(block, triton.next_power_of_2(numel))
    grid = (entries, triton.cdiv(numel, block))
    _update_slots_kernel[grid](model_out, latents, history, noise, index.contiguous(), coefs.contiguous(),
                               numel, NUM_COEFS=NUM_COEFS, BLOCK=block)


def update_slots(model_out, latents, history, noise, index, coefs) -> None:
    """The CPU path is the torch reference; on CUDA the Triton kernel."""
    if latents.is_cuda and triton is not None:
        update_slots_triton(model_out, latents, history, noise, index, coefs)
    else:
        update_slots_reference(model_out, latents, history, noise, index, coefs)
