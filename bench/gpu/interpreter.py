"""Part `interpreter` (CPU too): the update kernel through TRITON_INTERPRET=1, in a child
process (`gpu_check.py --interpreter-worker`), against the torch reference, bit for bit:
random cases, NaN outputs, strided views."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import torch

from . import report
from .kernel_cases import compare_kernel, random_inputs
from .report import check, row

REPO = pathlib.Path(__file__).resolve().parents[2]
GPU_CHECK = REPO / "bench" / "gpu_check.py"  # the child starts as the script does: carried wheels first


def worker() -> int:
    """Child process (TRITON_INTERPRET=1): CPU cases, one JSON row per line on stdout."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    # compare_kernel's checks go to the parent as JSON lines on stdout
    report.send_rows_to(lambda r: print("ROW " + json.dumps(r), flush=True))
    cases = [("random fp32", dict(entries=6, shape=(4, 8, 8), model_dtype=torch.float32, seed=1)),
             ("random bf16", dict(entries=5, shape=(4, 6, 6), model_dtype=torch.bfloat16, seed=2)),
             ("NaN model output", dict(entries=6, shape=(4, 8, 8), model_dtype=torch.float32, seed=3,
                                       nan_fraction=0.1))]
    for name, kw in cases:
        compare_kernel("interpreter", name, random_inputs(device="cpu", **kw))
    t = random_inputs(6, (4, 8, 8), torch.float32, seed=4, device="cpu")
    wide = torch.full((t["model_out"].shape[0], 2 * t["model_out"].shape[1]), 31337.0)
    wide[:, : t["model_out"].shape[1]] = t["model_out"]
    t["model_out"] = wide[:, : t["model_out"].shape[1]]  # out[:, :C]: row stride 2 × numel
    compare_kernel("interpreter", "learned-sigma out[:, :C] view", t)
    return 0


def run(args) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(GPU_CHECK), "--interpreter-worker"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=str(REPO))
    rows = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]
    for r in rows:
        row(**r)
    ok = proc.returncode == 0 and rows and all(r["status"] != "FAIL" for r in rows)
    check("interpreter", "TRITON_INTERPRET=1 child", "cases passed", len(rows), bool(ok),
          f"{time.perf_counter() - t0:.1f} s" + ("" if proc.returncode == 0 else f"; rc {proc.returncode}: "
                                                 + proc.stderr[-400:].replace("\n", " | ")))
