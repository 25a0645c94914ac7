#!/usr/bin/env bash
# Step 1 of the device run (bench/gpu_check.py --help has step 2): fetch, on this machine,
# the wheels that bench/gpu_check.py needs on a lent GPU machine that lacks them (no
# registry can be reached from there). That machine runs Python 3.12 (x86-64) with torch
# 2.11 / triton 3.6 and numpy, safetensors, huggingface-hub, regex, requests, Pillow,
# filelock already installed, but no diffusers, msgspec, pyzmq, transformers or peft; the
# project itself is NOT installed there (its torch pin is newer than the machine's torch):
# gpu_check puts bench/.wheels/site first on sys.path itself.
#
#   bash bench/device_wheels.sh          # → bench/.wheels/*.whl  (gitignored: bench/.wheels/)
#
# then on the device, with the carry list ["bench/.wheels"]:
#   python3 bench/gpu_check.py --quick   # unpacks the wheels into bench/.wheels/site on first use
#
# What is fetched: those packages and everything they need, at the versions this
# checkout's own environment runs (read from its installed metadata, `PYTHON`), less what
# the machine has (torch, triton, numpy, CUDA libraries, and the list above), each wheel
# alone (--no-deps: a resolver would pull torch), built for CPython 3.12 on manylinux x86-64.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=bench/.wheels
PY=${PYTHON:-python3}
mkdir -p "$DEST"
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
PINS=$("$PY" - <<'PYEOF'
import importlib.metadata as metadata

from packaging.requirements import Requirement

# the lent machine's environment, for the requirements' markers (extras: none)
MACHINE = {"python_version": "3.12", "python_full_version": "3.12.0", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
           "platform_machine": "x86_64", "os_name": "posix", "extra": ""}

WANTED = ["diffusers", "msgspec", "pyzmq", "transformers", "tokenizers", "peft", "accelerate"]
ON_THE_MACHINE = {"torch", "triton", "numpy", "pillow", "safetensors", "regex", "requests", "filelock", "urllib3",
                  "charset-normalizer", "certifi", "idna", "setuptools", "colorama", "tomli", "exceptiongroup"}
seen, todo = {}, list(WANTED)
while todo:
    name = todo.pop()
    key = name.lower().replace("_", "-")
    if key in seen or key in ON_THE_MACHINE or key.startswith("nvidia-"):
        continue
    try:
        seen[key] = metadata.version(name)
        requires = metadata.requires(name) or []
    except metadata.PackageNotFoundError:
        continue  # a need of another platform or Python (none of this checkout's)
    for requirement in map(Requirement, requires):
        if requirement.marker is None or requirement.marker.evaluate(MACHINE):
            todo.append(requirement.name)
print(" ".join(f"{name}=={version}" for name, version in sorted(seen.items())))
PYEOF
)
echo "wheels for the device: $PINS"
# shellcheck disable=SC2086
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$DEST" $PINS
rm -rf "$DEST/site"   # gpu_check re-unpacks from the wheels
ls -l "$DEST"
du -sh "$DEST"        # the carry limit is 64 MiB in all
