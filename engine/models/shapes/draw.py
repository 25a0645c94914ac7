"""Draws the training images of the `shapes` model and classifies drawn or sampled ones.

An image is one coloured shape (circle, square, triangle, cross) in pure-ish red, green
or blue, of random size and position, on a plain grey-level background. The classifier
is deterministic: it takes the saturated pixels as the shape, the dominant channel as
the colour and simple statistics of the mask's bounding box as the shape's kind.
"""
from __future__ import annotations

import numpy as np

COLORS = ("red", "green", "blue")
SHAPES = ("circle", "square", "triangle", "cross")
CONDITIONS = tuple(f"{c} {s}" for c in COLORS for s in SHAPES)
NULL_CONDITION = ""
SIZE = 32
_RGB = np.array([[0.9, 0.1, 0.1], [0.1, 0.85, 0.1], [0.1, 0.15, 0.95]], dtype=np.float32)


def _mask(shape: str, cy: float, cx: float, s: float) -> np.ndarray:
    y, x = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32) + 0.5
    dy, dx = y - cy, x - cx
    h = s / 2
    if shape == "circle":
        return dy**2 + dx**2 <= h**2
    if shape == "square":
        return (np.abs(dy) <= 0.85 * h) & (np.abs(dx) <= 0.85 * h)
    if shape == "triangle":  # apex up, base at the bottom
        frac = (dy + h) / (2 * h)  # 0 at apex, 1 at base
        return (frac >= 0) & (frac <= 1) & (np.abs(dx) <= frac * h)
    if shape == "cross":
        arm = h / 3
        inside = (np.abs(dy) <= h) & (np.abs(dx) <= h)
        return inside & ((np.abs(dy) <= arm) | (np.abs(dx) <= arm))
    raise ValueError(f"unknown shape {shape!r}")


def draw(n: int, rng: np.random.Generator, labels: np.ndarray | None = None):
    """Draw `n` images. Returns (uint8 images n×32×32×3, condition indices n)."""
    if labels is None:
        labels = rng.integers(0, len(CONDITIONS), size=n)
    images = np.empty((n, SIZE, SIZE, 3), dtype=np.float32)
    for i, label in enumerate(labels):
        color, shape = divmod(int(label), len(SHAPES))
        s = rng.uniform(12, 22)
        cy, cx = rng.uniform(s / 2 + 1, SIZE - s / 2 - 1, size=2)
        grey = rng.uniform(0.3, 0.7)
        img = np.full((SIZE, SIZE, 3), grey, dtype=np.float32)
        img[_mask(SHAPES[shape], cy, cx, s)] = _RGB[color]
        images[i] = img
    return (images * 255 + 0.5).astype(np.uint8), np.asarray(labels)


def classify(images: np.ndarray) -> list[tuple[str | None, str | None]]:
    """(colour, shape) of each uint8 H×W×3 image; None where nothing is found.

    The shape is the set of saturated pixels: the background is grey (equal channels), a
    shape is one strong primary, so the spread between channels separates them, and
    unsaturated halos or smudges around a sampled shape do not count as shape."""
    out = []
    for img in np.asarray(images, dtype=np.float32) / 255.0:
        mask = img.max(axis=-1) - img.min(axis=-1) > 0.4
        if mask.sum() < 12:
            out.append((None, None))
            continue
        color = COLORS[int(np.argmax(img[mask].mean(axis=0)))]
        out.append((color, _shape_of(mask)))
    return out


def _shape_of(mask: np.ndarray) -> str:
    """Shape from the mask's bounding box, in box-relative coordinates: a square fills its
    corners, a triangle (apex up) is bottom-heavy, a circle fills more of its box than a
    cross. Soft, decoded edges shift each figure a little but not across these bounds."""
    ys, xs = np.nonzero(mask)
    box = mask[ys.min():ys.max() + 1, xs.min():xs.max() + 1].astype(np.float32)
    h, w = box.shape
    yy = (np.arange(h)[:, None] + 0.5) / h - 0.5
    xx = (np.arange(w)[None, :] + 0.5) / w - 0.5
    corners = (np.abs(yy) > 0.3) & (np.abs(xx) > 0.3)
    if box[corners].mean() > 0.7:
        return "square"
    top, bottom = box[(yy < -1 / 6).ravel()].mean(), box[(yy > 1 / 6).ravel()].mean()
    if bottom > 1.6 * top:
        return "triangle"
    return "circle" if box.mean() > 0.68 else "cross"
