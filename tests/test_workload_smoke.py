"""Smoke: `bench/workload.py --quick` runs end to end as a script (from another directory):
every quick default system is the same engine process (the baseline as a core behind the core
Protocol, `--core bench.baselines:make_pipeline_batch_core`; `continuous+srpt` with `--policy
srpt`; `NAME@latent` the same flags with every request asking for output="latent"), driven by
several client processes through an idle short-latency measurement, a capacity probe and a
below- and an above-capacity run; it prints a table with a row per system and run, the
headlines with their targets (met / MISSED), a RESULTS block, a JSON that `python -m engine
queue-instrument --from-run` accepts, and a PNG. The figures are not asserted (the machine is
shared); that every system ran, completed requests with usable outputs of its kind, exited 0
and left no shm segments is. Also: how a result is judged usable; system names and slugs; the
baseline core, in-process, equals the diffusers pipeline's output."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "workload.py"
SYSTEMS = ("static+compact", "continuous+compact", "continuous+srpt", "diffusers-batched",
           "continuous+compact@latent", "continuous+srpt@latent")
COMPACT = ("static+compact", "continuous+compact", "continuous+srpt", "continuous+compact@latent",
           "continuous+srpt@latent")
RUNS = ("below", "above")
COLUMNS = ("system", "run", "offered/s", "load", "done", "canc", "rej", "fail", "goodput/s", "service/s",
           "ttuo_p50", "ttuo_p99", "ttuo_mean", "short_p50", "short_queue", "long_p99", "encode_ms", "hit%",
           "useful", "padded", "useful%", "cpu_s", "img/cpu_s")
TARGETS = {"goodput_png_over_latent:fifo", "goodput_png_over_latent:srpt",
           "short_p50_over_idle:continuous+compact", "short_p50_over_idle:continuous+srpt",
           "short_p50_over_idle:continuous+compact@latent", "short_p50_over_idle:continuous+srpt@latent",
           "long_p99_srpt_over_fifo", "long_p99_srpt_over_fifo@latent"}


def output_of(system: str) -> str:
    return "latent" if system.endswith("@latent") else "png"


@pytest.mark.timeout(330)
def test_workload_quick_runs_every_system_below_and_above_capacity(tmp_path):
    out_json, out_png = tmp_path / "workload.json", tmp_path / "workload.png"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--model", "tiny-sd", "--json", str(out_json),
                           "--plot", str(out_png)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=310)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"

    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["system", "run", "offered/s"])
    assert tuple(lines[header].split()) == COLUMNS
    col = {name: k for k, name in enumerate(COLUMNS)}
    rows = {}
    for line in lines[header + 2:]:
        cells = line.split()
        if not cells or cells[0] not in SYSTEMS:
            break
        assert len(cells) == len(COLUMNS), line
        rows[cells[0], cells[1]] = cells
    assert set(rows) == {(s, r) for s in SYSTEMS for r in RUNS}, proc.stdout
    for key, cells in rows.items():
        assert int(cells[col["done"]]) > 0 and int(cells[col["fail"]]) == 0, (key, cells)
        assert float(cells[col["goodput/s"]]) > 0 and float(cells[col["cpu_s"]]) > 0, (key, cells)
        assert float(cells[col["ttuo_mean"]]) > 0 and float(cells[col["short_p50"]]) > 0, (key, cells)
    for system in COMPACT:
        for run in RUNS:
            assert int(rows[system, run][col["padded"]]) == 0, (system, run)  # compact computes no padded rows
    assert "---- RESULTS.md block ----" in proc.stdout and "capacity (burst probe" in proc.stdout
    assert "Idle short latency (median time to usable output of 5 single 2-step requests" in proc.stdout

    report = json.loads(out_json.read_text())
    assert set(report["capacities"]) == set(SYSTEMS) and all(v > 0 for v in report["capacities"].values())

    # the engines: srpt's flags, each system's output kind, a clean exit, no shm left, a safe socket name
    assert set(report["engines"]) == set(SYSTEMS)
    for name, engine in report["engines"].items():
        assert engine["output"] == output_of(name), name
        assert engine["exit_code"] == 0 and engine["shm_leftovers"] == [] and engine["peak_rss_mb"] > 0, name
        socket = engine["address"].rsplit("/", 1)[1]
        assert "@" not in socket and "+" not in socket and socket.endswith(".sock"), engine["address"]
    flags = {name: " ".join(engine["flags"]) for name, engine in report["engines"].items()}
    for name in ("continuous+srpt", "continuous+srpt@latent"):
        assert "--admission continuous --layout compact --policy srpt" in flags[name], flags
    for name in ("continuous+compact", "continuous+compact@latent"):
        assert "--admission continuous --layout compact --policy fifo" in flags[name], flags
    assert len({e["address"] for e in report["engines"].values()}) == len(SYSTEMS)

    # the idle short latency: 5 single shortest-class requests per system, each usable
    assert set(report["idle"]) == set(SYSTEMS)
    for name, idle in report["idle"].items():
        assert idle["output"] == output_of(name) and idle["steps"] == 2, name
        assert idle["n"] == 5 and idle["usable"] == 5 and len(idle["samples"]) == 5, (name, idle)
        assert all(s["kind"] == "completed" and s["usable"] and s["total_s"] > 0 for s in idle["samples"]), name
        assert 0 < idle["median_s"] <= max(s["total_s"] for s in idle["samples"]), name

    # every run: every request ended completed (with a usable output of its kind) or canceled
    assert set(report["configs"]) == {f"{s}@{r}" for s in SYSTEMS for r in RUNS}
    for name, config in report["configs"].items():
        system = name.rsplit("@", 1)[0]
        assert config["output"] == output_of(system), name
        assert config["completed"] > 0 and config["unusable"] == 0, (name, config["completed"], config["unusable"])
        assert config["completed"] + config["canceled"] == config["requests"], name
        assert config["failed"] == config["rejected"] == config["timeouts"] == 0, name
        assert config["errors"] == [] and config["shm_leftovers"] == [] and config["exit_code"] == 0, name
        assert config["arrival_rate"] > 0 and config["service_rate"] >= 0, name
        assert config["backlog"] and all(len(pair) == 2 for pair in config["backlog"]), name
        assert config["ttuo_mean"] > 0 and config["short_ttuo_p50"] > 0, name
        records = report["records"][name]
        assert len(records) == config["requests"], name
        assert all(r["output"] == output_of(system) for r in records), name
        completed = [r for r in records if r["kind"] == "completed"]
        assert len(completed) == config["completed"] and all(r["usable"] is True for r in completed), name
    for system in SYSTEMS:
        assert report["configs"][f"{system}@above"]["long_ttuo_p99"] > 0, system
    above = report["configs"]["continuous+compact@above"]
    assert above["load"] > 1 and min(report["configs"][f"{s}@below"]["load"] for s in SYSTEMS) < 1

    # the targets: every one measured (met or MISSED, not "not measured"), each printed
    targets = {t["name"]: t for t in report["targets"]}
    assert TARGETS <= set(targets), sorted(targets)
    for name in TARGETS:
        t = targets[name]
        assert t["status"] in ("met", "MISSED") and t["value"] > 0, t
        assert (t["status"] == "met") == (t["value"] >= t["target"] if t["op"] == ">=" else t["value"] <= t["target"])
    assert all(targets[f"mean_ttuo:{run}{suffix}"]["value"] > 0 for run in RUNS for suffix in ("", "@latent"))
    for key, phrase in (("goodput_png_over_latent:srpt", "PNG goodput / latent goodput, srpt: continuous+srpt"),
                        ("short_p50_over_idle:continuous+srpt", "2-step p50 TTUO / idle short latency, srpt"),
                        ("long_p99_srpt_over_fifo", "8-step p99 TTUO srpt / fifo (continuous+srpt vs")):
        line = next((line for line in lines if phrase in line), None)
        assert line is not None and line.endswith(f"x: {targets[key]['status']})"), (phrase, line)
    assert sum("mean TTUO fifo (continuous+compact" in line for line in lines) >= 4  # below/above × png/latent

    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.path.isdir("/dev/shm"):  # checked here too, after the script exited: an engine's segments carry its pid
        prefixes = tuple(f"diffslot-{e['pid']}-" for e in report["engines"].values())
        assert all(isinstance(e["pid"], int) and e["pid"] > 0 for e in report["engines"].values())
        assert [n for n in os.listdir("/dev/shm") if n.startswith(prefixes)] == []

    check = subprocess.run([sys.executable, "-m", "engine", "queue-instrument", "--from-run", str(out_json)],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    for name in report["configs"]:
        assert f"config {name}:" in check.stdout


def test_usable_judges_png_and_latent_outputs():
    """A PNG of the expected size; a finite, not constant float32 latent of the expected shape."""
    import struct
    import zlib

    sys.path.insert(0, str(ROOT / "bench"))
    from workload_trace import usable

    from frontend import Canceled, Completed, Timings

    def png(width, height):
        ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
        crc = struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
        return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + ihdr + crc

    def completed(output, kind):
        msg = Completed(request_id="r", timings=Timings(), output_kind=kind, shape=(), dtype="uint8")
        msg.output = output
        return msg

    expect = dict(size=[16, 24], latent_shape=[4, 8, 12])  # (height, width)
    good = np.random.default_rng(0).standard_normal((4, 8, 12)).astype(np.float32)
    assert usable(completed(png(24, 16), "png"), "png", expect)
    assert not usable(completed(png(16, 24), "png"), "png", expect)  # width and height swapped
    assert not usable(completed(b"GIF89a" + png(24, 16)[6:], "png"), "png", expect)
    assert not usable(completed(good, "latent"), "png", expect)  # asked for a PNG, got a latent
    assert usable(completed(good, "latent"), "latent", expect)
    assert not usable(completed(good.astype(np.float64), "latent"), "latent", expect)
    assert not usable(completed(good[:, :, :8], "latent"), "latent", expect)
    assert not usable(completed(np.zeros_like(good), "latent"), "latent", expect)
    bad = good.copy()
    bad[1, 2, 3] = np.nan
    assert not usable(completed(bad, "latent"), "latent", expect)
    assert not usable(completed(png(24, 16), "png"), "latent", expect)
    assert not usable(Canceled(request_id="r"), "latent", expect)


def test_system_names_and_slugs():
    sys.path.insert(0, str(ROOT / "bench"))
    import workload

    flags, output = workload.parse_system("continuous+srpt@latent")
    assert flags == ["--admission", "continuous", "--layout", "compact", "--policy", "srpt"] and output == "latent"
    assert workload.parse_system("static+padded") == (["--admission", "static", "--layout", "padded"], "png")
    with pytest.raises(KeyError):
        workload.parse_system("continuous+fast@latent")
    with pytest.raises(ValueError):
        workload.parse_system("continuous+compact@jpeg")
    slugs = [workload.slug_of(k, n) for k, n in enumerate(workload.DEFAULT_SYSTEMS)]
    assert slugs[-1] == f"{len(slugs) - 1}-continuous-srpt-latent" and len(set(slugs)) == len(slugs)
    assert all(set(s) <= set("abcdefghijklmnopqrstuvwxyz0123456789-") for s in slugs), slugs
    assert {"continuous+srpt", "continuous+compact@latent", "continuous+srpt@latent"} <= set(workload.QUICK_SYSTEMS)
    assert workload.main(["--systems", "continuous+compact@webp"]) == 2  # rejected before any engine starts


@pytest.mark.timeout(120)
def test_the_baseline_core_equals_the_pipeline(tmp_path):
    """bench.baselines' diffusers-batched core, in-process: one pipeline call for requests
    with the same (steps, sampler, guidance, size), each result equal to the diffusers
    pipeline run alone (DESIGN.md, "Reference semantics"), a second call for another key, and a cancel
    answered at once while its row runs to the end of the call (counted as padded)."""
    import torch

    sys.path.insert(0, str(ROOT))  # bench.baselines, as the engine process imports it from the repo root
    from bench.baselines import PipelineBatchCore
    from core_driver import run_to_end
    from engine.core import CoreConfig, StepProgress
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

    def cancel_r2_after_its_first_step(d, outputs):
        if any(isinstance(o, StepProgress) and o.request_id == "r2" and o.step == 1 for o in outputs):
            core.abort_requests(["r2"])

    d = run_to_end(core, {f"r{i}": p for i, p in enumerate(params)}, after_step=cancel_r2_after_its_first_step)
    finished, canceled = d.finished, list(d.canceled)
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
