"""Model folders: the embedded `shapes` model and any diffusers-format folder.

`resolve` finds a folder; `engine.models.loading.load_model` loads it for the core.
"""
from __future__ import annotations

import pathlib

SHAPES_DIR = pathlib.Path(__file__).resolve().parent / "shapes" / "weights"


def resolve(name_or_path: str | pathlib.Path) -> pathlib.Path:
    """Return the local folder of a model: `shapes` (embedded) or a path.

    A pipeline folder as diffusers saves it (`model_index.json` names the pipeline:
    StableDiffusionPipeline, StableDiffusion3Pipeline), or the class-conditional layout
    (`unet/`, `vae/`, `scheduler/`, `conditions.json`: condition strings in class-index
    order, the null condition last).
    """
    path = SHAPES_DIR if str(name_or_path) == "shapes" else pathlib.Path(name_or_path).expanduser().resolve()
    if (path / "model_index.json").exists():
        return path
    missing = [p for p in ("unet", "vae", "scheduler", "conditions.json") if not (path / p).exists()]
    if missing:
        raise FileNotFoundError(f"model folder {path} has no model_index.json (a diffusers pipeline folder) "
                                f"and lacks {', '.join(missing)} of the class-conditional layout")
    return path
