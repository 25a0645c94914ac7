"""Model folders: the embedded models (`shapes`, `shapes-dit`) and any diffusers-format folder.

`resolve` finds a folder; `engine.models.loading.load_model` loads it for the core.
"""
from __future__ import annotations

import pathlib

SHAPES_DIR = pathlib.Path(__file__).resolve().parent / "shapes" / "weights"
SHAPES_DIT_DIR = pathlib.Path(__file__).resolve().parent / "shapes" / "dit_weights"
#: The models that ship with the engine, by name: `shapes` (a StableDiffusionPipeline, UNet)
#: and `shapes-dit` (a FluxPipeline, transformer), trained on the same drawn shapes.
EMBEDDED = {"shapes": SHAPES_DIR, "shapes-dit": SHAPES_DIT_DIR}


def embedded_name(path: str | pathlib.Path) -> str | None:
    """The name of the embedded model at `path`, or None."""
    path = pathlib.Path(path).expanduser().resolve()
    return next((name for name, folder in EMBEDDED.items() if folder == path), None)


def resolve(name_or_path: str | pathlib.Path) -> pathlib.Path:
    """Return the local folder of a model: an embedded one by name (`EMBEDDED`) or a path.

    A pipeline folder as diffusers saves it (`model_index.json` names the pipeline:
    StableDiffusionPipeline, StableDiffusion3Pipeline, FluxPipeline, ...), or the class-conditional layout
    (`unet/`, `vae/`, `scheduler/`, `conditions.json`: condition strings in class-index
    order, the null condition last).
    """
    path = EMBEDDED.get(str(name_or_path)) or pathlib.Path(name_or_path).expanduser().resolve()
    if (path / "model_index.json").exists():
        return path
    missing = [p for p in ("unet", "vae", "scheduler", "conditions.json") if not (path / p).exists()]
    if missing:
        raise FileNotFoundError(f"model folder {path} has no model_index.json (a diffusers pipeline folder) "
                                f"and lacks {', '.join(missing)} of the class-conditional layout")
    return path
