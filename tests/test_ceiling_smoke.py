"""Smoke: `bench/ceiling.py --quick` runs end to end as a script (from another directory):
it starts an engine with default flags, serves the same requests with latent and with PNG
outputs, measures the in-process denoiser at the engine's own rows per call after each,
and prints and writes the ratios. The ratios' values are not asserted (the machine is
shared); that both outputs are measured, consistently, with real outputs, is. The check
that decides what counts as a PNG result is tested on its own, with outputs that must not
count. The suite's autouse guard (tests/conftest.py) fails the test on any process or
shared-memory segment left behind."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import re
import statistics
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "ceiling.py"
REQUESTS, STEPS, SLOTS, REPEATS = 8, 4, 4, 3  # --quick

pytestmark = pytest.mark.timeout(300)


def _ceiling_module():
    sys.path.insert(0, str(SCRIPT.parent))  # its `from workload_common import ...`, as when run as a script
    try:
        spec = importlib.util.spec_from_file_location("bench_ceiling_under_test", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(SCRIPT.parent))


def test_only_real_outputs_count():
    """The ceiling counts a result through the workload's own judge (`workload_trace.usable`)."""
    import io

    from PIL import Image

    from engine.protocol import Completed, Failed, Timings

    ceiling = _ceiling_module()
    usable, expect = ceiling.usable, dict(latent_shape=(4, 8, 8), size=(32, 32))

    def completed(output, kind="png"):
        msg = Completed("r", Timings(evals=8), kind, (0,), "uint8")
        msg.output = output
        return msg

    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(buffer, format="PNG")
    png = buffer.getvalue()
    latent = np.random.default_rng().standard_normal((4, 8, 8)).astype(np.float32)
    assert usable(completed(png), "png", expect)
    assert not usable(completed(b"GIF89a" + b"\0" * 32), "png", expect)
    assert not usable(completed(b""), "png", expect)
    assert not usable(completed(None), "png", expect)
    assert not usable(completed(latent, "latent"), "png", expect)
    assert not usable(Failed("r", "boom"), "png", expect)
    assert usable(completed(latent, "latent"), "latent", expect)
    assert not usable(completed(np.zeros((4, 8, 9), np.float32), "latent"), "latent", expect)
    assert not usable(completed(png), "latent", expect)


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_ceiling_quick_measures_latent_and_png(tmp_path):
    out_json = tmp_path / "ceiling.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--model", "tiny-sd", "--threads", "1",
                           "--json", str(out_json)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    report = json.loads(out_json.read_text())
    assert report["engine_exit"] == 0
    assert (report["requests"], report["steps"], report["slots"]) == (REQUESTS, STEPS, SLOTS)
    per = report["rows_per_request"]
    assert per == 2  # guidance 3 on an SD UNet: a conditional and an unconditional row per request
    full = SLOTS * per
    repeats = report["repeats"]
    assert len(repeats) == REPEATS
    for repeat in repeats:
        assert set(repeat) == {"latent", "png", "png_latent"}
        for output in ("latent", "png"):
            m = repeat[output]
            s, d = m["served"], m["denoiser"]
            assert s["output"] == output and s["kinds"] == ["Completed"]
            assert s["submitted"] == s["counted"] == REQUESTS, s
            # every row of every request, computed once, and counted from the results themselves
            assert s["useful_evals"] == s["counted_evals"] == REQUESTS * STEPS * per, s
            assert REQUESTS * STEPS // SLOTS <= s["batches"] <= REQUESTS * STEPS, s
            assert s["mean_rows"] == pytest.approx(s["useful_evals"] / s["batches"])
            assert per <= s["mean_rows"] <= full
            assert s["rows_per_s"] == pytest.approx(s["counted_evals"] / s["wall_s"])
            assert all(_positive(s[k]) for k in ("rows_per_s", "wall_s", "engine_cpu_s", "denoiser_s")), s
            assert 0 < s["denoiser_share"] <= 1.0, s
            # the denoiser alone, at the served run's own rows per call, as many calls
            assert d["rows"] == pytest.approx(s["mean_rows"])
            assert d["rows_lo"] <= s["mean_rows"] <= d["rows_hi"] and d["rows_hi"] - d["rows_lo"] in (0, per), d
            assert d["rows_lo"] % per == 0 and d["rows_hi"] % per == 0, d
            assert sum(p["calls"] for p in d["points"].values()) == d["calls"] >= s["batches"], d
            assert {int(k) for k in d["points"]} == {d["rows_lo"], d["rows_hi"]}, d
            rates = [p["rows_per_s"] for p in d["points"].values()]
            assert all(_positive(r) for r in rates) and min(rates) - 1e-9 <= d["rows_per_s"] <= max(rates) + 1e-9
            for key in ("ratio", "cpu_ratio", "in_call_ratio"):
                assert _positive(m[key]), (key, m[key])
            assert m["ratio"] == pytest.approx(s["rows_per_s"] / d["rows_per_s"])
        png, latent = repeat["png"]["served"], repeat["latent"]["served"]
        assert png["signatures"] == ["89504e470d0a1a0a"], png  # every output's first 8 bytes
        assert png["decoded_size"] == [report["native_size"]] * 2, png  # and one decodes whole, at size
        assert latent["shapes"] == [report["latent_shape"]], latent
        assert repeat["png_latent"] == pytest.approx(png["rows_per_s"] / latent["rows_per_s"])
        assert _positive(repeat["png_latent"])
    medians = report["medians"]
    for output in ("latent", "png"):
        assert medians[output]["ratio"] == pytest.approx(statistics.median(g[output]["ratio"] for g in repeats))
        assert medians[output]["rows"] == pytest.approx(statistics.median(g[output]["served"]["mean_rows"]
                                                                          for g in repeats))
    assert medians["png_latent"] == pytest.approx(statistics.median(g["png_latent"] for g in repeats))
    # the headline printed is the one written
    number = r"([0-9]+(?:\.[0-9]+)?)"
    for output in ("latent", "png"):
        line = re.search(rf"^served {output} / denoiser at {number} rows = {number} \(median of {REPEATS}\)",
                         proc.stdout, re.M)
        assert line, proc.stdout
        assert float(line.group(1)) == pytest.approx(medians[output]["rows"], abs=0.006)
        assert float(line.group(2)) == pytest.approx(medians[output]["ratio"], abs=0.0006)
    assert re.search(r"^served png / .*; target >= 0\.9: (met|MISSED)$", proc.stdout, re.M), proc.stdout
    line = re.search(rf"^png / latent goodput = {number} \(median of {REPEATS}\)", proc.stdout, re.M)
    assert line and float(line.group(1)) == pytest.approx(medians["png_latent"], abs=0.0006), proc.stdout
    table = [row.split() for row in proc.stdout.splitlines() if re.match(r"^[0-9]+\s+(latent|png)\s", row)]
    assert sorted((int(r[0]), r[1]) for r in table) == [(k, o) for k in range(1, REPEATS + 1)
                                                        for o in ("latent", "png")], proc.stdout
