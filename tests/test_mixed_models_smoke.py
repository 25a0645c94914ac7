"""Smoke: `bench/mixed_models.py --quick` runs as a script: SDXL, FLUX and Qwen-Image
requests of three sizes each end (one canceled per model), in one group per size, and calls
mix rows of different per-request inputs (Qwen-Image: prompt lengths) and steps."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.timeout(240)
def test_mixed_models_bench_quick(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "mixed_models.py"), "--quick", "--threads", "1"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()
            if line.split() and line.split()[0] in ("sdxl", "flux", "qwen")}
    assert set(rows) == {"sdxl", "flux", "qwen"}, proc.stdout
    for kind, (done, canceled, calls, groups, useful, mixing_inputs, mixing_lengths, mixing_steps, _) in rows.items():
        assert (int(done), int(canceled), int(groups)) == (11, 1, 3), (kind, rows[kind])
        assert float(useful) >= 1.0 and int(mixing_steps) > 0, (kind, rows[kind])
        # SDXL and FLUX mix per-row inputs; their prompts are one length. Qwen-Image mixes lengths.
        assert (int(mixing_inputs) > 0) == (kind != "qwen"), (kind, rows[kind])
        assert (int(mixing_lengths) > 0) == (kind == "qwen"), (kind, rows[kind])
