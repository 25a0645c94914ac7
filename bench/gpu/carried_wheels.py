"""The packages the lent GPU machine lacks (diffusers, msgspec, pyzmq, transformers, peft and
what they need), from the wheels that `bench/device_wheels.sh` downloads into
bench/.wheels. Imports nothing beyond the standard library: it runs before torch and the
engine are imported."""
from __future__ import annotations

import importlib.util
import pathlib
import sys
import zipfile

WHEELS = pathlib.Path(__file__).resolve().parents[1] / ".wheels"

#: what the parts import that the lent machine lacks (bench/device_wheels.sh fetches them)
CARRIED = ("diffusers", "msgspec", "zmq", "transformers", "tokenizers", "peft", "accelerate")


def use_carried_wheels() -> None:
    """Put bench/.wheels' packages on sys.path when the machine lacks them (the lent GPU
    machine): each wheel unzipped once into bench/.wheels/site (a wheel is a zip of its
    installed files). Nothing is installed into the machine's Python."""
    missing = [module for module in CARRIED if importlib.util.find_spec(module) is None]  # found, not imported
    if not missing:
        return
    site = WHEELS / "site"
    wheels = sorted(WHEELS.glob("*.whl"))
    if not wheels:
        print(f"gpu_check: {', '.join(missing)} missing and no wheels in {WHEELS} (run bench/device_wheels.sh here)",
              flush=True)
        return
    stamp = site / ".unpacked"
    names = "\n".join(w.name for w in wheels)
    if not stamp.exists() or stamp.read_text() != names:
        site.mkdir(parents=True, exist_ok=True)
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as z:
                z.extractall(site)
        stamp.write_text(names)
    sys.path.insert(0, str(site))
