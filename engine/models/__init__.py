"""Model sources: the embedded models (`shapes`, `shapes-dit`), a diffusers-format folder,
a Hugging Face hub id, or a single-file checkpoint.

`resolve` finds the local folder (or file) of a model, downloading a hub id only when it
is not in the local cache and the hub may be reached; `engine.models.loading.load_model`
loads it for the core. Both say what went wrong in one line (`ModelNotFound`,
`ModelLoadError`).
"""
from __future__ import annotations

import os
import pathlib
import re

SHAPES_DIR = pathlib.Path(__file__).resolve().parent / "shapes" / "weights"
SHAPES_DIT_DIR = pathlib.Path(__file__).resolve().parent / "shapes" / "dit_weights"
#: The models that ship with the engine, by name: `shapes` (a StableDiffusionPipeline, UNet)
#: and `shapes-dit` (a FluxPipeline, transformer), trained on the same drawn shapes.
EMBEDDED = {"shapes": SHAPES_DIR, "shapes-dit": SHAPES_DIT_DIR}


def embedded_name(path: str | pathlib.Path) -> str | None:
    """The name of the embedded model at `path`, or None."""
    path = pathlib.Path(path).expanduser().resolve()
    return next((name for name, folder in EMBEDDED.items() if folder == path), None)

#: the suffixes of single-file checkpoints (A1111 / ComfyUI / original Stability releases)
SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin")
#: a hub id: `name` or `org/name` of letters, digits, `-`, `_`, `.` (not a path to a file)
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")


class ModelNotFound(FileNotFoundError):
    """No model where the user pointed: the message says where it looked."""


class ModelLoadError(ValueError):
    """A model that was found but cannot be loaded: the message names the part and why."""


def is_single_file(path: pathlib.Path) -> bool:
    return path.is_file() and path.suffix in SINGLE_FILE_SUFFIXES


def resolve(name_or_path: str | pathlib.Path, revision: str | None = None,
            variant: str | None = None) -> pathlib.Path:
    """The local folder of a model, or its single-file checkpoint.

    - `shapes`, `shapes-dit`: the embedded models (`EMBEDDED`);
    - a folder: a pipeline folder as diffusers saves it (`model_index.json` names the
      pipeline), or the class-conditional layout (`unet/`, `vae/`, `scheduler/`,
      `conditions.json`: condition strings in class-index order, the null condition last);
    - a file (`.safetensors`, `.ckpt`, ...): a single-file checkpoint;
    - otherwise a hub id (`org/name`): the snapshot in the Hugging Face cache (`revision`:
      a branch, tag or commit; `variant`: e.g. fp16, whose weights are the ones fetched),
      downloaded first when it is not there and the hub may be reached.
    """
    text = str(name_or_path)
    if text in EMBEDDED:
        return EMBEDDED[text]
    path = pathlib.Path(text).expanduser()
    if path.exists():
        if revision is not None:
            raise ValueError(f"--revision {revision!r} applies to hub ids; {text} is a local path")
        path = path.resolve()
        if path.is_file() and not is_single_file(path):
            raise ModelNotFound(f"model {text!r}: a file, but not a checkpoint ({', '.join(SINGLE_FILE_SUFFIXES)}); "
                                "a pipeline is a folder")
        return path if path.is_file() else _check_folder(path)
    if _HUB_ID.match(text) and "/" in text and not text.startswith("."):
        return _from_hub(text, revision, variant)
    raise ModelNotFound(f"model {text!r}: no such file or folder ({path.resolve()}), and not a hub id (org/name)")


def display_name(path: str | pathlib.Path) -> str:
    """What clients are told a model is: an embedded one's name, a hub id for a snapshot in
    the hub's cache (`.../models--org--name/snapshots/REV`), else the folder's or file's name."""
    embedded = embedded_name(path)
    if embedded is not None:
        return embedded
    path = pathlib.Path(path)
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.removeprefix("models--").replace("--", "/")
    return path.name


def _check_folder(path: pathlib.Path) -> pathlib.Path:
    if (path / "model_index.json").exists():
        return path
    missing = [p for p in ("unet", "vae", "scheduler", "conditions.json") if not (path / p).exists()]
    if missing:
        raise ModelNotFound(f"model folder {path} has no model_index.json (a diffusers pipeline folder) "
                            f"and lacks {', '.join(missing)} of the class-conditional layout")
    return path


def hub_cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _from_hub(repo_id: str, revision: str | None, variant: str | None) -> pathlib.Path:
    """The snapshot folder of a diffusers pipeline on the hub: from the local cache, else
    downloaded (only the files the pipeline loads, as diffusers chooses them)."""
    from diffusers import DiffusionPipeline
    from huggingface_hub import constants

    where = f"revision {revision}" if revision else "its main branch"
    try:
        return pathlib.Path(DiffusionPipeline.download(repo_id, revision=revision, variant=variant,
                                                       local_files_only=True))
    except (OSError, ValueError) as cached_error:
        miss = one_line(cached_error)
    local = f"no folder or file {pathlib.Path(repo_id).resolve()}, and as a hub id ({where}) it is"
    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise ModelNotFound(f"model {repo_id!r}: {local} not in the Hugging Face cache {hub_cache_dir()}, and "
                            f"HF_HUB_OFFLINE is set, so it was not downloaded ({miss})")
    try:
        return pathlib.Path(DiffusionPipeline.download(repo_id, revision=revision, variant=variant))
    except Exception as exc:  # noqa: BLE001 - network, authentication, a missing repo: all said in one line
        raise ModelNotFound(f"model {repo_id!r}: {local} not in the Hugging Face cache {hub_cache_dir()}, and "
                            f"downloading it failed: {one_line(exc)}") from None


def one_line(exc: BaseException) -> str:
    """An exception's message on one line, at most 300 characters."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."
