"""Smoke: `bench/bench_compaction.py --quick` runs as a script (from another directory) on
the tiny text-to-image (StableDiffusionPipeline) folder and prints a table with a row for
every layout at every quick fraction, and writes its JSON and plot."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from engine.core.config import LAYOUTS

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "bench_compaction.py"
QUICK_FRACTIONS = (0.25, 1.0)
COLUMNS = 11  # layout, fraction, active, rows, useful, step, build, denoiser, host, evals/s, vs padded

pytestmark = pytest.mark.timeout(300)


def test_compaction_quick_mode_prints_every_layout_row(tmp_path):
    out_json, out_png = tmp_path / "compaction.json", tmp_path / "compaction.png"
    command = [sys.executable, str(SCRIPT), "--quick", "--model", "tiny-sd", "--slots", "8", "--repeats", "2",
               "--warmup", "0", "--threads", "1", "--json", str(out_json), "--plot", str(out_png)]
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"

    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["layout", "fraction"])
    rows = {}
    for line in lines[header + 2:]:
        cells = line.split()
        if not cells:
            continue  # blank line between fractions
        if cells[0] not in LAYOUTS:
            break
        assert len(cells) == COLUMNS, line
        layout, fraction, active, computed, useful = cells[0], float(cells[1]), *map(int, cells[2:5])
        step_ms, build_ms, denoise_ms, host_ms, rate, vs_padded = map(float, cells[5:])
        assert step_ms > 0 and build_ms > 0 and denoise_ms > 0 and host_ms > 0 and rate > 0, line
        assert denoise_ms < step_ms, line
        assert active == round(fraction * 8) and useful <= computed, line
        rows[layout, fraction] = dict(rows=computed, useful=useful, vs_padded=vs_padded)
    assert set(rows) == {(layout, f) for layout in LAYOUTS for f in QUICK_FRACTIONS}, proc.stdout
    for f in QUICK_FRACTIONS:
        assert rows["padded", f]["rows"] == 16 and rows["padded", f]["vs_padded"] == 1.0
        assert rows["compact", f]["rows"] == rows["compact", f]["useful"]
        assert rows["compact", f]["rows"] <= rows["bucketed", f]["rows"] <= 16

    report = json.loads(out_json.read_text())
    assert report["meta"]["model"] == "tiny-sd" and report["meta"]["slots"] == 8
    assert {(r["layout"], r["fraction"]) for r in report["results"]} == set(rows)
    assert all(len(r["samples_ms"]) == 2 for r in report["results"])
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(240)
def test_http_load_quick_prints_the_gateway_overhead():
    """`bench/http_load.py --quick --fake-core`: the same trace through the HTTP gateway and
    the direct client, side by side; the table's 'gateway added' row carries numbers."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "http_load.py"), "--quick", "--fake-core"],
                          cwd="/", capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    added = next(line for line in proc.stdout.splitlines() if line.startswith("gateway added"))
    p50, p99 = (float(x) for x in added.split()[2:4])
    assert p50 <= p99 and abs(p50) < 1000, added  # a difference of medians: noise may make it small
