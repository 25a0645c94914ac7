"""Draws the training images of the `shapes` model, and distractors for its classifier.

An image is one coloured shape (circle, square, triangle, cross) in pure-ish red, green
or blue, of random size and position, on a plain grey-level background. `draw_distractors`
draws look-alikes that are none of the four (ellipses, diamonds, blobs) in the same
colours and backgrounds: `classify` (in `classify.py`) must read them as "unknown".
"""
from __future__ import annotations

import numpy as np

COLORS = ("red", "green", "blue")
SHAPES = ("circle", "square", "triangle", "cross")
CONDITIONS = tuple(f"{c} {s}" for c in COLORS for s in SHAPES)
NULL_CONDITION = ""
PROMPTS = tuple(f"a {c}" for c in CONDITIONS)  # "a red circle", ...: what the text model is trained on
SIZE = 32
_RGB = np.array([[0.9, 0.1, 0.1], [0.1, 0.85, 0.1], [0.1, 0.15, 0.95]], dtype=np.float32)


def shape_mask(shape: str, cy: float, cx: float, s: float) -> np.ndarray:
    """Boolean SIZE×SIZE mask of `shape` of size `s` centred at (cy, cx), pixel centres."""
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
        img[shape_mask(SHAPES[shape], cy, cx, s)] = _RGB[color]
        images[i] = img
    return (images * 255 + 0.5).astype(np.uint8), np.asarray(labels)


DISTRACTORS = ("ellipse", "diamond", "blob")


def distractor_mask(kind: str, cy: float, cx: float, s: float, rng: np.random.Generator) -> np.ndarray:
    """A figure that is none of SHAPES, its extent about `s`: an ellipse (axis ratio
    0.45-0.7, any orientation), a diamond (a square standing on a corner) or a blob (a
    circle whose radius wobbles by 2, 3 and 4 lobes of 12-22% each)."""
    y, x = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32) + 0.5
    dy, dx = y - cy, x - cx
    h = s / 2
    if kind == "ellipse":
        b = h * rng.uniform(0.45, 0.7)
        th = rng.uniform(0, np.pi)
        u, v = dx * np.cos(th) + dy * np.sin(th), -dx * np.sin(th) + dy * np.cos(th)
        return (u / h) ** 2 + (v / b) ** 2 <= 1
    if kind == "diamond":
        return np.abs(dx) + np.abs(dy) <= h
    if kind == "blob":
        theta, r = np.arctan2(dy, dx), np.hypot(dy, dx)
        radius = np.ones_like(r)
        for k in (2, 3, 4):
            radius += rng.uniform(0.12, 0.22) * np.cos(k * theta + rng.uniform(0, 2 * np.pi))
        return r <= 0.8 * h * radius
    raise ValueError(f"unknown distractor {kind!r}")


def draw_distractors(n: int, rng: np.random.Generator, kinds=DISTRACTORS):
    """Draw `n` distractor images. Returns (uint8 images n×32×32×3, kind names n)."""
    names = [kinds[int(k)] for k in rng.integers(0, len(kinds), size=n)]
    images = np.empty((n, SIZE, SIZE, 3), dtype=np.float32)
    for i, kind in enumerate(names):
        color = int(rng.integers(0, len(COLORS)))
        s = rng.uniform(14, 22)
        cy, cx = rng.uniform(s / 2 + 1, SIZE - s / 2 - 1, size=2)
        img = np.full((SIZE, SIZE, 3), rng.uniform(0.3, 0.7), dtype=np.float32)
        img[distractor_mask(kind, cy, cx, s, rng)] = _RGB[color]
        images[i] = img
    return (images * 255 + 0.5).astype(np.uint8), names
