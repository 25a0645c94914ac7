"""The adapter folder: the names it offers and where a name's file is, without ever
reaching outside it. An adapter is a `NAME.safetensors` file or a `NAME/` folder holding
`pytorch_lora_weights.safetensors` (as `save_lora_weights` writes); hidden entries are
skipped (partial copies), and so is any entry whose real path leaves the folder (a
symbolic link to elsewhere)."""
from __future__ import annotations

import os
import pathlib

#: The file `save_lora_weights` writes into a folder.
FOLDER_WEIGHTS = "pytorch_lora_weights.safetensors"

#: The longest adapter name (a file name's limit on common file systems).
MAX_NAME_BYTES = 255


class AdapterFolder:
    def __init__(self, lora_dir: pathlib.Path):
        self.lora_dir = lora_dir

    def inside(self, path: pathlib.Path) -> bool:
        """The file is in the folder once links are followed (a link may point within it)."""
        try:
            return os.path.realpath(path).startswith(os.path.realpath(self.lora_dir) + os.sep)
        except OSError:
            return False

    def scan(self) -> set[str]:
        """The names the folder offers now: `NAME.safetensors` files and `NAME/` folders
        holding `pytorch_lora_weights.safetensors` (hidden entries skipped: partial copies;
        so are links that lead out of the folder)."""
        found = set()
        try:
            entries = list(os.scandir(self.lora_dir))
        except OSError:
            return found
        for entry in entries:
            if entry.name.startswith("."):
                continue
            try:
                if entry.is_dir():
                    path, name = pathlib.Path(entry.path) / FOLDER_WEIGHTS, entry.name
                elif entry.name.endswith(".safetensors"):
                    path, name = pathlib.Path(entry.path), entry.name.removesuffix(".safetensors")
                else:
                    continue
                if path.is_file() and self.inside(path):
                    found.add(name)
            except OSError:
                continue
        return found

    def locate(self, name: str) -> pathlib.Path | str | None:
        """The adapter's file, why the name is ambiguous, or None. Only plain names: a
        request's name never reaches outside the folder."""
        if not name or name.startswith(".") or any(c in name for c in "/\\\0") or name != name.strip() \
                or len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
            return None
        file, folder = self.lora_dir / f"{name}.safetensors", self.lora_dir / name / FOLDER_WEIGHTS
        try:
            in_file = file.is_file() and self.inside(file)
            in_folder = folder.is_file() and self.inside(folder)
        except OSError:  # a name the file system cannot hold
            return None
        if in_file and in_folder:
            return f"ambiguous: both {name}.safetensors and a folder {name}/ are in the adapter folder"
        return file if in_file else folder if in_folder else None
