"""Smoke: the decode-stage, admission-policy, priorities and step-cache benchmarks and the soak run as
scripts (`--quick`) and print a row for every configuration with plausible numbers, the
policies' aging sweep too."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_script(name: str, tmp_path, *args: str) -> list[str]:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / name), "--quick", "--threads", "1", *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout.splitlines()


@pytest.mark.timeout(300)
def test_decode_modes_quick(tmp_path):
    lines = run_script("decode_modes.py", tmp_path)
    rows = {line[:14].strip(): line[14:].split() for line in lines if line[:14].strip() in
            ("latent", "png inline", "png thread", "png worker")}
    assert set(rows) == {"latent", "png inline", "png thread", "png worker"}, lines
    assert float(rows["latent"][1]) == 1.0
    for name, (goodput, ratio, call_ms, rows_per_call, share) in rows.items():
        assert float(goodput) > 0 and float(ratio) > 0 and float(rows_per_call) >= 1, (name, lines)


@pytest.mark.timeout(300)
def test_soak_quick(tmp_path):
    """A few seconds of every kind of traffic against an engine and its gateway: every kind
    ran, nothing was lost or wedged, both processes' RSS and the bystander were measured."""
    lines = run_script("soak.py", tmp_path)
    text = "\n".join(lines)
    kinds = ("text to image (engine)", "text to image (gateway)", "images at the limit (engine)",
             "images at the limit (gateway)", "adapter (engine)", "canceled (engine)", "abandoned (gateway)",
             "upload slow (gateway)", "idle connection")
    rows = {line[:32].strip(): line[32:].split() for line in lines if line[:32].strip() in kinds}
    assert set(rows) == set(kinds), text
    for kind, row in rows.items():
        assert row[4:6] == ["0", "0"], (kind, text)  # lost, wedged
    assert "lost 0, wedged 0: ok" in text
    rss = {line.split()[0]: float(line.split()[2]) for line in lines if line.split()[:1] in (["engine"], ["gateway"])}
    assert set(rss) == {"engine", "gateway"} and all(mb > 10 for mb in rss.values()), text
    assert "bystander 4-step" in text


@pytest.mark.timeout(300)
def test_policies_quick(tmp_path):
    lines = run_script("policies.py", tmp_path)
    traces = (["burst"], ["saturated"], ["below"])
    rows = [line.split() for line in lines if line.split()[:1] in traces]
    assert sorted((r[0], r[1]) for r in rows) == [(t, p) for t in ("below", "burst", "saturated")
                                                  for p in ("fifo", "srpt")], lines
    for row in rows:
        assert all(float(v) > 0 for v in row[2:]), row
    idle = [line for line in lines if line.startswith("idle:")]
    assert len(idle) == 1 and float(idle[0].split()[5]) > 0, lines


@pytest.mark.timeout(300)
def test_policies_aging_sweep_quick(tmp_path):
    """`--srpt-aging` runs SRPT once per multiple (inf: unbounded) on the chosen traces only."""
    lines = run_script("policies.py", tmp_path, "--traces", "saturated", "--rate", "8", "--srpt-aging", "2,inf")
    rows = [line.split() for line in lines if line.split()[:1] in (["burst"], ["saturated"], ["below"])]
    assert sorted((r[0], r[1]) for r in rows) == [("saturated", "fifo"), ("saturated", "srpt/aging=2"),
                                                  ("saturated", "srpt/aging=inf")], lines
    for row in rows:
        assert all(float(v) > 0 for v in row[2:]), row


@pytest.mark.timeout(300)
def test_priorities_quick(tmp_path):
    """Every system prints its row; with priorities and preemption the interactive requests
    park batch work (preemptions and bytes moved are counted), without they never do."""
    lines = run_script("priorities.py", tmp_path)
    rows = {line.split()[0]: line.split()[1:] for line in lines if line.split()[:1] in
            (["preempt"], ["priority"], ["srpt"])}
    assert set(rows) == {"preempt", "priority", "srpt"}, lines
    for values in rows.values():
        assert all(float(v) > 0 for v in values[:3]), values
    assert float(rows["preempt"][3]) >= 1 and float(rows["preempt"][4]) > 0, rows["preempt"]
    assert float(rows["priority"][3]) == 0 and float(rows["srpt"][3]) == 0


@pytest.mark.timeout(300)
def test_step_cache_quick(tmp_path):
    """Every configuration prints its row; caching off is the 1.00 baseline, and a cache
    that skips work computes fewer rows per call than off."""
    from engine.testing.tiny_pipelines import build_flux

    folder = build_flux(tmp_path / "flux", seed=3, layers=2, single_layers=2)
    lines = run_script("step_cache.py", tmp_path, "--model", str(folder), "--requests", "6", "--slots", "4",
                       "--steps", "4", "--size", "16")
    rows = _cache_rows(lines)
    assert set(rows) == {"off", "first_block 0.1", "mag 0.06", "taylorseer 2/2"}, lines
    assert rows["off"][1] == "1.00" and float(rows["off"][3]) == 0.0
    assert float(rows["mag 0.06"][3]) > 0 and float(rows["mag 0.06"][2]) < float(rows["off"][2]), lines
    assert all(float(cells[0]) > 0 for cells in rows.values())


def _cache_rows(lines: list[str]) -> dict[str, list[str]]:
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines
                                              if line.startswith("| ") and not line.startswith("| cache"))}


@pytest.mark.timeout(300)
def test_step_cache_named_configurations(tmp_path):
    """`--configs` runs the settings it names, the first as the baseline; TaylorSeer Lite's
    rows skip every block on its prediction steps."""
    from engine.testing.tiny_pipelines import build_flux

    folder = build_flux(tmp_path / "flux", seed=3, layers=2, single_layers=2)
    lines = run_script("step_cache.py", tmp_path, "--model", str(folder), "--requests", "4", "--slots", "4",
                       "--steps", "4", "--size", "16", "--configs", "off,mag:0.06,taylorseer-lite:2/1")
    rows = _cache_rows(lines)
    assert list(rows) == ["off", "mag 0.06", "taylorseer-lite 2/1"], lines
    lite = rows["taylorseer-lite 2/1"]
    assert float(lite[3]) > 0 and float(lite[2]) < float(rows["off"][2]), lines


@pytest.mark.timeout(300)
def test_step_cache_served_quick(tmp_path):
    """The served run (PNG outputs, progress, a cancel) prints a row per setting: every
    request answered, progress seen, and only the cached run skipped steps."""
    lines = run_script("step_cache_served.py", tmp_path)
    rows = {cells[1]: cells[2:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines
                                              if line.startswith("| 0 "))}
    assert set(rows) == {"off", "mag:0.06"}, lines
    for name, (completed, canceled, goodput, p50, p90, skipped, wasted, accuracy) in rows.items():
        assert int(completed) + int(canceled) == 8 and int(completed) >= 5, (name, lines)
        assert float(goodput) > 0 and 0 < float(p50) <= float(p90), (name, lines)
    assert float(rows["off"][5]) == 0 and float(rows["mag:0.06"][5]) > 0, lines
    assert any(line.startswith("goodput mag:0.06 / off per repeat:") for line in lines), lines


@pytest.mark.timeout(300)
def test_controlnet_quick(tmp_path):
    """The three systems (per-row ControlNets, ControlNet-keyed groups, the ControlNet on every
    row) each print a row; they give the same latents; the call-cost line is there."""
    import json

    lines = run_script("controlnet.py", tmp_path, "--json", str(tmp_path / "controlnet.json"))
    rows = [line.split() for line in lines if line.split()[1:2] in (["mixed"], ["keyed"], ["all-rows"])]
    assert sorted(r[1] for r in rows) == ["all-rows", "keyed", "mixed"], lines
    for row in rows:
        assert int(row[2]) > 0 and all(float(v) > 0 for v in row[3:6]), row
    groups = {r[1]: int(r[-1]) for r in rows}
    # one size: per-row ControlNets share one group; keyed groups split it by ControlNet set
    assert groups["mixed"] == groups["all-rows"] == 1 and groups["keyed"] > 1, groups
    report = json.loads((tmp_path / "controlnet.json").read_text())
    assert report["worst_rel_l2"] < 1e-4, report["worst_rel_l2"]
    cost = report["call_ms"]
    assert cost["plain"] > 0 and cost["gathered"] > 0 and cost["every row"] > 0
    assert any(line.startswith("one call of") for line in lines), lines
