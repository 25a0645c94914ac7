"""Smoke: `bench/workload.py --quick` runs end to end as a script (from another directory):
it starts a real engine process per configuration (and the diffusers-style baseline
server), drives each from several client processes, prints a table with a row for every
configuration, and writes a JSON that `python -m engine queue-instrument --from-run`
accepts, and a PNG. The figures themselves are not asserted (the machine is shared)."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "workload.py"
CONFIGS = ("static+padded", "continuous+padded", "continuous+compact", "continuous+bucketed", "diffusers-batched")
COLUMNS = 14  # config, offered/s, done, canc, rej, fail, goodput/s, service/s, useful, padded, canc.ev, useful%, peakMB, decMB

pytestmark = pytest.mark.timeout(300)


def test_workload_quick_runs_every_configuration(tmp_path):
    out_json, out_png = tmp_path / "workload.json", tmp_path / "workload.png"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out_json), "--plot", str(out_png)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"

    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["config", "offered/s"])
    rows = {}
    for line in lines[header + 2:]:
        cells = line.split()
        if not cells or cells[0] not in CONFIGS:
            break
        assert len(cells) == COLUMNS, line
        rows[cells[0]] = cells
    assert set(rows) == set(CONFIGS), proc.stdout
    for name, cells in rows.items():
        done, canceled, rejected, failed = map(int, cells[2:6])
        assert done > 0 and failed == 0, (name, cells)
        assert float(cells[6]) > 0, (name, cells)  # goodput
    assert int(rows["continuous+compact"][9]) == 0  # compact computes no padded rows
    assert "engine overhead per step" in proc.stdout and "targets" in proc.stdout

    report = json.loads(out_json.read_text())
    assert set(report["configs"]) == set(CONFIGS)
    for name, config in report["configs"].items():
        assert config["arrival_rate"] > 0 and config["service_rate"] > 0, name
        assert config["backlog"] and all(len(pair) == 2 for pair in config["backlog"]), name
        assert config["errors"] == [] and config["shm_leftovers"] == [], name
        assert config["peak_rss_mb"] > 0, name
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    check = subprocess.run([sys.executable, "-m", "engine", "queue-instrument", "--from-run", str(out_json)],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    for name in CONFIGS:
        assert f"config {name}:" in check.stdout
