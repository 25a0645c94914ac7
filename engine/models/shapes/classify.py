"""A deterministic classifier for the `shapes` model's images: `classify(images)` gives
"red circle", ..., or "unknown" for each 32×32 uint8 image.

The shape is the set of saturated pixels (the background is grey, a shape one strong
primary, so the spread between channels separates them; the unsaturated halo of a
decoded edge does not count). The colour is the dominant channel of those pixels, and it
must dominate clearly. The kind is found by fitting each of the four figures exactly as
`draw` draws them, and a diamond (centre and size searched around the mask's bounding
box), and taking the best intersection-over-union; the best must be one of the four,
reach that figure's `MIN_IOU`, and the mask's box must be about square, so an ellipse, a
diamond, a blob, two shapes or a smudge read "unknown" rather than as whichever figure
happens to be nearest.
"""
from __future__ import annotations


import numpy as np

from engine.models.shapes.draw import COLORS, SHAPES, distractor_mask, shape_mask

UNKNOWN = "unknown"
SATURATION = 0.4  # channel spread (max - min, 0..1) above which a pixel is shape
MIN_PIXELS = 30  # the smallest drawn figure (a cross of size 12) has about 80
# The least IoU of an accepted best fit, per figure. Measured on fresh drawings passed
# through the trained VAE (as a perfect latent model would give them), the worst true
# fits were circle 0.93, square 0.97, triangle 0.84, cross 0.82; the best fits of
# distractors (ellipses, blobs) were below 0.85 as a circle or a square, 0.71 as a
# triangle, 0.77 as a cross. A diamond fits a cross up to 0.80, so a diamond is fitted
# too and wins over the four when it fits best.
MIN_IOU = {"circle": 0.88, "square": 0.9, "triangle": 0.8, "cross": 0.79}
MIN_COLOR_MARGIN = 0.25  # dominant channel minus the next one, mean over the shape
MAX_ASPECT = 1.2  # every figure's box is square (to the pixel); an ellipse's is not
_GRID = [g.reshape(-1, 1, 1) for g in np.meshgrid(  # centre and size offsets of the fits
    [-0.5, 0.0, 0.5], [-0.5, 0.0, 0.5], [-1.0, -0.5, 0.0, 0.5, 1.0], indexing="ij")]
# Each figure's box extent in units of its size `s`: a square's side is 0.85 s.
_EXTENT = {"circle": 1.0, "square": 0.85, "triangle": 1.0, "cross": 1.0, "diamond": 1.0}


def classify(images: np.ndarray) -> list[str]:
    """"colour shape" (e.g. "red circle") or "unknown" for each uint8 H×W×3 image."""
    return [classify_one(img) for img in np.asarray(images)]


def classify_one(image: np.ndarray) -> str:
    color, shape, _ = explain(image)
    return UNKNOWN if color is None or shape is None else f"{color} {shape}"


def explain(image: np.ndarray) -> tuple[str | None, str | None, dict]:
    """(colour or None, shape or None, the figures behind the decision)."""
    img = np.asarray(image, dtype=np.float32) / 255.0
    mask = img.max(axis=-1) - img.min(axis=-1) > SATURATION
    info: dict = {"pixels": int(mask.sum())}
    if mask.sum() < MIN_PIXELS:
        return None, None, info
    means = np.sort(img[mask].mean(axis=0))
    info["color_margin"] = float(means[-1] - means[-2])
    color = COLORS[int(np.argmax(img[mask].mean(axis=0)))] if info["color_margin"] >= MIN_COLOR_MARGIN else None
    ys, xs = np.nonzero(mask)
    h, w = ys.max() + 1 - ys.min(), xs.max() + 1 - xs.min()
    info["aspect"] = float(max(h, w) / min(h, w))
    ious = {s: _best_iou(mask, s, ys, xs) for s in SHAPES + ("diamond",)}
    info["iou"] = ious
    best = max(ious, key=ious.get)
    shape = best if best in SHAPES and ious[best] >= MIN_IOU[best] and info["aspect"] <= MAX_ASPECT else None
    return color, shape, info


def _best_iou(mask: np.ndarray, shape: str, ys: np.ndarray, xs: np.ndarray) -> float:
    """The best IoU of `mask` with `shape` drawn around the mask's bounding box: centre
    moved by up to half a pixel, size by up to a pixel, all fits at once."""
    cy0, cx0 = (ys.min() + ys.max() + 1) / 2, (xs.min() + xs.max() + 1) / 2
    extent = (ys.max() + 1 - ys.min() + xs.max() + 1 - xs.min()) / 2
    cy, cx, size = cy0 + _GRID[0], cx0 + _GRID[1], (extent + _GRID[2]) / _EXTENT[shape]
    tmpl = distractor_mask(shape, cy, cx, size, None) if shape == "diamond" else shape_mask(shape, cy, cx, size)
    inter = np.count_nonzero(tmpl & mask, axis=(1, 2))
    union = np.count_nonzero(tmpl | mask, axis=(1, 2))
    return float((inter / union).max())


__all__ = ["UNKNOWN", "classify", "classify_one", "explain"]
