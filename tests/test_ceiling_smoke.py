"""Smoke: `bench/ceiling.py --quick` runs end to end as a script (from another directory):
it starts an engine with default flags beside an in-process denoiser and core, and
prints per-repeat rows/s and the median ratios. The ratios are not asserted (the
machine is shared); that they are measured and sane is."""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "ceiling.py"

pytestmark = pytest.mark.timeout(300)


def test_ceiling_quick_prints_the_ratio(tmp_path):
    out_json = tmp_path / "ceiling.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--model", "tiny-sd", "--threads", "1",
                           "--json", str(out_json)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    served = re.search(r"served engine / denoiser = ([0-9.]+) \(median of 3\)", proc.stdout)
    core = re.search(r"core alone / denoiser = ([0-9.]+)", proc.stdout)
    assert served and core, proc.stdout
    assert 0 < float(served.group(1)) < 2 and 0 < float(core.group(1)) < 2, proc.stdout
    report = json.loads(out_json.read_text())
    assert len(report["repeats"]) == 3 and report["engine_exit"] == 0
    for repeat in report["repeats"]:
        assert repeat["served"]["rows_per_s"] > 0 and repeat["denoiser"]["rows_per_s"] > 0
        assert 0 < repeat["core"]["denoiser_share"] <= 1.0
