"""Random prompt rows in place of text encoders, which are off the denoiser's path: the
model parts measure the denoiser under the engine, not the encoders."""
from __future__ import annotations

import hashlib

import torch

TEXT_TOKENS, TEXT_WIDTH = 77, 768  # CLIP's context and SD 1.5's hidden width


def random_rows(text: str, shape: tuple, device, dtype) -> torch.Tensor:
    """Fixed random rows per text: a stand-in for a text encoder (off the denoiser's path)."""
    seed = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little")
    g = torch.Generator(device).manual_seed(seed)
    return torch.randn(*shape, device=device, generator=g, dtype=dtype)
