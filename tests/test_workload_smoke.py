"""Smoke: `bench/workload.py --quick` runs end to end as a script (from another directory):
every default system is the same engine process (the baseline as a core behind the core
Protocol, `--core bench.baselines:make_pipeline_batch_core`), driven by several client
processes through a capacity probe and a below- and an above-capacity run; it prints a
table with a row per system and run, a RESULTS block, a JSON that `python -m engine
queue-instrument --from-run` accepts, and a PNG. The figures are not asserted (the machine
is shared). Also: the baseline core, in-process, equals the diffusers pipeline's output."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "workload.py"
SYSTEMS = ("static+padded", "static+compact", "continuous+compact", "diffusers-batched")
RUNS = ("below", "above")
COLUMNS = 21  # system, run, offered/s, load, done, canc, rej, fail, goodput/s, service/s, ttuo_p50, ttuo_p99,
# short_p50, short_queue, encode_ms, hit%, useful, padded, useful%, cpu_s, img/cpu_s


@pytest.mark.timeout(300)
def test_workload_quick_runs_every_system_below_and_above_capacity(tmp_path):
    out_json, out_png = tmp_path / "workload.json", tmp_path / "workload.png"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--model", "tiny-sd", "--json", str(out_json),
                           "--plot", str(out_png)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"

    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["system", "run", "offered/s"])
    rows = {}
    for line in lines[header + 2:]:
        cells = line.split()
        if not cells or cells[0] not in SYSTEMS:
            break
        assert len(cells) == COLUMNS, line
        rows[cells[0], cells[1]] = cells
    assert set(rows) == {(s, r) for s in SYSTEMS for r in RUNS}, proc.stdout
    for key, cells in rows.items():
        done, canceled, rejected, failed = map(int, cells[4:8])
        assert failed == 0, (key, cells)
        assert float(cells[8]) >= 0 and float(cells[19]) > 0, (key, cells)  # goodput, engine CPU seconds
    for run in RUNS:
        assert int(rows["continuous+compact", run][17]) == 0  # compact computes no padded rows
        assert int(rows["static+compact", run][17]) == 0
    assert "---- RESULTS.md block ----" in proc.stdout and "capacity (burst probe" in proc.stdout

    report = json.loads(out_json.read_text())
    assert set(report["capacities"]) == set(SYSTEMS) and all(v > 0 for v in report["capacities"].values())
    assert set(report["configs"]) == {f"{s}@{r}" for s in SYSTEMS for r in RUNS}
    for name, config in report["configs"].items():
        assert config["arrival_rate"] > 0 and config["service_rate"] >= 0, name
        assert config["backlog"] and all(len(pair) == 2 for pair in config["backlog"]), name
        assert config["errors"] == [] and config["shm_leftovers"] == [] and config["exit_code"] == 0, name
        assert config["peak_rss_mb"] > 0, name
    above = report["configs"]["continuous+compact@above"]
    assert above["load"] > 1 and report["configs"]["static+padded@below"]["load"] < 1
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    check = subprocess.run([sys.executable, "-m", "engine", "queue-instrument", "--from-run", str(out_json)],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    for name in report["configs"]:
        assert f"config {name}:" in check.stdout


@pytest.mark.timeout(120)
def test_the_baseline_core_equals_the_pipeline(tmp_path):
    """bench.baselines' diffusers-batched core, in-process: one pipeline call for requests
    with the same (steps, sampler, guidance, size), each result equal to the diffusers
    pipeline run alone (DESIGN.md section 3), a second call for another key, and a cancel
    answered at once while its row runs to the end of the call (counted as padded)."""
    import torch

    sys.path.insert(0, str(ROOT))  # bench.baselines, as the engine process imports it from the repo root
    from bench.baselines import PipelineBatchCore
    from engine.core import CoreConfig, DenoiseFinished, RequestCanceled, StepProgress
    from engine.models.loading import load_model
    from engine.protocol import GenerateParams
    from engine.testing.pipeline_oracle import pipeline_output
    from engine.testing.tiny_pipelines import build_sd

    torch.set_num_threads(1)
    folder = build_sd(tmp_path / "sd")
    core = PipelineBatchCore(load_model(folder), CoreConfig(slots=4))
    specs = [("a red circle", "euler", 3.0), ("a blue square", "euler", 3.0), ("a green cross", "euler", 3.0),
             ("a red cross", "dpmpp_2m", 1.0)]
    params = [GenerateParams(prompt=p, steps=4, sampler=s, guidance=g, seed=i, output="latent")
              for i, (p, s, g) in enumerate(specs)]
    for i, p in enumerate(params):
        core.add_request(f"r{i}", p)
    finished, canceled, progress = {}, [], []
    while core.has_unfinished_requests():
        for out in core.step():
            if isinstance(out, StepProgress):
                progress.append((out.request_id, out.step))
                if out.request_id == "r2" and out.step == 1:
                    core.abort_requests(["r2"])
            elif isinstance(out, DenoiseFinished):
                finished[out.request_id] = out
                assert core.decode_done(out.request_id)
            elif isinstance(out, RequestCanceled):
                canceled.append(out.request_id)
    assert canceled == ["r2"] and set(finished) == {"r0", "r1", "r3"}
    for i in (0, 1, 3):
        p = params[i]
        ref = pipeline_output(str(folder), p.sampler, p.prompt, p.steps, p.guidance, p.seed)
        got = finished[f"r{i}"].latents.numpy()
        assert float(((got - ref) ** 2).sum() ** 0.5 / (ref ** 2).sum() ** 0.5) < 1e-4, i
    stats = core.stats()
    assert stats["pipeline_calls"] == 2 and stats["completed"] == 3
    assert stats["padded_evals"] == 3 * 2  # r2's two rows in the 3 steps after its cancel
    assert finished["r0"].timings.encode_s > 0 and finished["r0"].timings.evals == 8
