"""Model folders: the embedded `shapes` model and any diffusers-format folder."""
from __future__ import annotations

import pathlib

SHAPES_DIR = pathlib.Path(__file__).resolve().parent / "shapes" / "weights"


def resolve(name_or_path: str | pathlib.Path) -> pathlib.Path:
    """Return the local diffusers-format folder of a model.

    The folder holds `unet/`, `vae/`, `scheduler/` and `conditions.json` (the
    condition strings in class-index order, the null condition last).
    """
    if str(name_or_path) == "shapes":
        path = SHAPES_DIR
    else:
        path = pathlib.Path(name_or_path).expanduser().resolve()
    missing = [p for p in ("unet", "vae", "scheduler", "conditions.json") if not (path / p).exists()]
    if missing:
        raise FileNotFoundError(f"model folder {path} lacks {', '.join(missing)}")
    return path
