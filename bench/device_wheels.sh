#!/usr/bin/env bash
# Fetch, on this machine, the pure-Python / binary wheels that bench/gpu_check.py needs on a
# lent GPU machine that lacks them (no registry can be reached from there). That machine
# runs Python 3.12 (x86-64) with torch 2.11 / triton 3.6 and numpy, safetensors,
# huggingface-hub, regex, requests, Pillow, filelock already installed, but no diffusers or
# msgspec; the project itself is NOT installed there (its torch pin is newer than the
# machine's torch): gpu_check puts bench/.wheels/site on sys.path itself.
#
#   bash bench/device_wheels.sh          # → bench/.wheels/*.whl  (gitignored: bench/.wheels/)
#
# then on the device, with `carry: ["bench/.wheels"]`:
#   python3 bench/gpu_check.py           # unpacks the wheels into bench/.wheels/site on first use
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=bench/.wheels
PY=${PYTHON:-python3}
mkdir -p "$DEST"
# Versions: what this checkout's own environment runs (diffusers 0.42.1, msgspec 0.23.0).
DIFFUSERS=${DIFFUSERS_VERSION:-0.42.1}
MSGSPEC=${MSGSPEC_VERSION:-0.23.0}
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# msgspec: a compiled extension, for CPython 3.12 on x86-64
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$DEST" "msgspec==$MSGSPEC"
# diffusers: pure Python (its other needs are on the machine already)
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$DEST" "diffusers==$DIFFUSERS"
rm -rf "$DEST/site"   # gpu_check re-unpacks from the wheels
ls -l "$DEST"
du -sh "$DEST"
