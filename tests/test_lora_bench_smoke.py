"""Smoke: `bench/lora.py --quick` runs as a script (from another directory): the three
systems (mixed adapters per call, adapter-keyed groups, fuse-per-call) replay the same
short trace with adapters, a cancel and mixed steps; every request ends the same way in
each, their final latents agree, and the table, the ratios, the LoRA overhead and the
JSON come out."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "lora.py"


@pytest.mark.timeout(240)
def test_lora_bench_quick_compares_the_three_systems(tmp_path):
    out = tmp_path / "lora.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--overhead-rounds", "2", "--json", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"

    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| ")]
    header, body = [c.strip() for c in rows[0]], [[c.strip() for c in r] for r in rows[1:]]
    assert header[:6] == ["system", "repeat", "done", "canc", "goodput img/s", "img / CPU s"], header
    assert sorted(r[0] for r in body) == ["fuse", "keyed", "mixed"], proc.stdout
    assert len({(r[2], r[3]) for r in body}) == 1, body  # the same requests completed and canceled in each
    assert all(int(r[3]) >= 1 and float(r[4]) > 0 for r in body), body  # a cancel; goodput measured
    assert any(line.startswith("mixed / keyed goodput:") for line in proc.stdout.splitlines()), proc.stdout
    assert any(line.startswith("mixed / fuse goodput:") for line in proc.stdout.splitlines()), proc.stdout

    report = json.loads(out.read_text())
    results = {r["system"]: r for r in report["results"]}
    assert results["mixed"]["rows_per_call"] >= results["keyed"]["rows_per_call"]
    assert all(r["adapter_loads"] >= 1 and r["failed"] == 0 for r in results.values())
    assert results["fuse"]["fuse_parts_ms_per_call"].get("fuse", 0) > 0  # it fused around its calls
    assert set(report["worst_rel_l2"]) == {"keyed", "fuse"}
    assert max(report["worst_rel_l2"].values()) <= 1e-3, report["worst_rel_l2"]  # same requests, same results
    assert report["overhead_worst_pct"] is not None, report["overhead"]  # lora_overhead.py ran and was read
