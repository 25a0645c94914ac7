"""`bench/gpu_check.py`'s own checks, on CPU: every device check's verdict
(`bench/gpu/judge.py`) fed a healthy and a broken measurement must pass the one and fail
the other, so that no check of the device run can pass whatever happens. The parts that
need CUDA run their engine code on CPU here where they can (the LoRA-in-the-engine waves,
the nosync whole life with a fake sync debug mode), and `--help` documents the one device
command."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.gpu import judge  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_bandwidth_below_the_copys_fails():
    assert judge.bandwidth(4000.0, 4500.0, finite=True).ok  # 0.89 of the copy
    assert not judge.bandwidth(2250.0, 4500.0, finite=True).ok  # 50 %
    assert not judge.bandwidth(4400.0, 4500.0, finite=False).ok  # fast, but the latents went non-finite
    assert not judge.bandwidth(4000.0, 0.0, finite=True).ok


@pytest.mark.parametrize("part", sorted(judge.THROUGHPUT_TARGETS))
def test_throughput_below_its_target_fails(part):
    target = judge.THROUGHPUT_TARGETS[part]
    assert judge.throughput(part, target * 100.0 + 0.01, 100.0, 16, 16, 0).ok
    assert not judge.throughput(part, target * 100.0 - 1.0, 100.0, 16, 16, 0).ok  # slower than stated
    assert not judge.throughput(part, 99.0, 100.0, 15, 16, 0).ok  # a request did not finish
    assert not judge.throughput(part, 99.0, 100.0, 16, 16, 1).ok  # one failed
    assert "target" in judge.throughput(part, 99.0, 100.0, 16, 16, 0).note


def test_graph_replays_made_at_start_up_capture_do_not_count():
    # six buckets captured at start-up, each replayed once then; 20 calls while serving
    assert judge.graph_replays(graphs=6, replays=26, replays_at_start=6, calls=20).ok
    # every serving call ran eagerly (a capture that failed): only the start-up replays
    assert not judge.graph_replays(graphs=6, replays=6, replays_at_start=6, calls=20).ok
    assert not judge.graph_replays(graphs=6, replays=20, replays_at_start=6, calls=20).ok  # some ran eagerly
    assert not judge.graph_replays(graphs=0, replays=0, replays_at_start=0, calls=20).ok


def _completions(n: int, every_s: float, decode_s: float = 0.0, start_s: float = 1.0) -> list[float]:
    """n completions every `every_s` after a start-up, each `decode_s` later (a decode's
    latency), the last four later still (the decodes queued when the denoiser ran out)."""
    return [start_s + k * every_s + decode_s + (decode_s * (k - n + 5) if k >= n - 4 else 0.0) for k in range(n)]


def test_png_goodput_judges_the_steady_state_not_the_decode_tail():
    latent = _completions(48, 0.05)
    healthy = _completions(48, 0.052, decode_s=0.3)  # a healthy decode beside the denoiser, its tail at the end
    ratio, verdict = judge.png_goodput(latent, healthy, 48, 0)
    whole = (len(healthy) / max(healthy)) / (len(latent) / max(latent))  # whole runs, the tail included
    assert verdict.ok and ratio >= judge.PNG_TARGET and whole < judge.PNG_TARGET  # the tail alone fails the whole run
    slowed = _completions(48, 0.05 / 0.8)  # the decode slows the denoiser to 80 %
    ratio, verdict = judge.png_goodput(latent, slowed, 48, 0)
    assert not verdict.ok and ratio == pytest.approx(0.8, rel=0.02)
    assert not judge.png_goodput(latent, healthy[:-1], 48, 0)[1].ok  # one request lost
    assert not judge.png_goodput(latent, healthy, 48, 1)[1].ok  # one error
    assert judge.steady_rate([1.0, 1.0, 1.0, 1.0]) == 0.0 and judge.steady_rate([1.0]) == 0.0


def test_the_reaper_hold_is_calibrated_on_the_measured_step():
    assert judge.hold_seconds(0.002) == judge.MIN_HOLD_S
    assert judge.hold_seconds(0.05) == pytest.approx(judge.HOLD_STEPS * 0.05)
    for step_s in (0.002, 0.05, 0.3):
        assert judge.reaper_hold(judge.hold_seconds(step_s), step_s).ok
    assert not judge.reaper_hold(0.06, 0.03).ok  # the old fixed 50 ms bar passed this: two steps' worth
    assert not judge.reaper_hold(0.0, 0.001).ok


class _FakeSyncDebug:
    """torch.cuda.set_sync_debug_mode as CUDA has it (CPU torch has none): a step that makes
    a synchronising call raises while the mode is "error"."""

    def __init__(self):
        self.mode, self.history = 0, []

    def __call__(self, mode) -> None:
        self.mode = mode
        self.history.append(mode)

    def synchronising_call(self) -> None:
        if self.mode == "error":
            raise RuntimeError("called a synchronizing CUDA operation\n(traceback ...)")


def test_a_sync_inside_a_step_is_caught_and_fails_the_check():
    fake = _FakeSyncDebug()
    assert judge.first_sync(lambda: None, fake) is None and fake.history == ["error", 0]
    found = judge.first_sync(fake.synchronising_call, fake)
    assert found == "called a synchronizing CUDA operation" and fake.mode == 0  # the mode is off after
    assert not judge.sync_free([found], steps=12).ok and judge.sync_free([], steps=12).ok
    assert not judge.sync_free([], steps=0).ok  # nothing ran: nothing shown
    with pytest.raises(RuntimeError, match="other"):  # any other error is the step's own
        judge.first_sync(lambda: (_ for _ in ()).throw(RuntimeError("other")), fake)
    assert fake.mode == 0


def test_a_step_that_waits_out_a_held_stream_fails():
    assert judge.held_step(0.004, 0.5).ok
    assert not judge.held_step(0.49, 0.5).ok  # it waited for the device (a .cpu(), an .item())
    assert not judge.held_step(0.004, 0.01).ok  # the hold never happened: nothing was shown
    assert not judge.held_step(0.004, 0.5, ok=False).ok  # the step did not do what it was for (publish)


def test_equal_within_needs_results():
    assert judge.equal_within({"a": 1e-6, "b": 2e-4}, 1e-3).ok
    assert not judge.equal_within({"a": 1e-6, "b": 2e-2}, 1e-3).ok
    assert not judge.equal_within({}, 1e-3).ok


@pytest.mark.timeout(300)
def test_the_nosync_whole_life_runs_its_requests_with_a_step_that_would_sync_caught(monkeypatch):
    """The nosync part's engine run, on CPU with the fake debug mode: every request of
    every kind ends, B is loaded meanwhile, nothing is flagged; then a step made to
    synchronise (as `.item()` would on CUDA) is flagged and the run stops there."""
    from bench.gpu import nosync

    fake = _FakeSyncDebug()
    life = nosync.whole_life("cpu", fake, lambda: None)
    assert not life["syncs"] and life["steps"] > 0 and life["requests"] <= life["ended"] and not life["failed"]
    assert life["loads_during"] == 1  # B, loaded by the loader thread while the others ran
    assert judge.sync_free(life["syncs"], life["steps"]).ok

    from engine.core.engine_core import EngineCore

    step = EngineCore.step
    monkeypatch.setattr(EngineCore, "step", lambda self: (fake.synchronising_call(), step(self))[1])
    life = nosync.whole_life("cpu", fake, lambda: None)
    assert life["syncs"] and life["steps"] == 1 and not judge.sync_free(life["syncs"], life["steps"]).ok


@pytest.mark.timeout(300)
def test_lora_engine_waves_on_cpu_evict_move_the_layout_and_equal_themselves():
    """The lora_engine part's run on CPU (the part compares CUDA against this): every
    request finishes, the pool evicts within its budget and LoCon moves the layout."""
    from bench.gpu.lora_engine import TOLERANCE, serve_waves

    first = serve_waves("cpu", waves=1)
    assert len(first["latents"]) == first["requests"] and not first["failed"]
    assert first["evictions"] >= 1 and first["peak"] <= first["budget"] and first["versions"] >= 2
    assert first["uncounted"] <= 0
    again = serve_waves("cpu", waves=1)
    errors = {rid: float((again["latents"][rid] - first["latents"][rid]).norm() / first["latents"][rid].norm())
              for rid in first["latents"]}
    assert judge.equal_within(errors, TOLERANCE).ok


def test_quick_cuts_the_flux_blocks():
    from bench.gpu.flux import FLUX_TRANSFORMER_CONFIG, flux_config

    full, quick = flux_config(False), flux_config(True)
    assert (full["num_layers"], full["num_single_layers"]) == (19, 38) == (
        FLUX_TRANSFORMER_CONFIG["num_layers"], FLUX_TRANSFORMER_CONFIG["num_single_layers"])
    assert quick["num_layers"] < 19 and quick["num_single_layers"] < 38
    assert {k: v for k, v in quick.items() if "layers" not in k} == {k: v for k, v in full.items() if "layers" not in k}


def test_help_documents_the_one_device_command_within_420_s():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--help"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "bash bench/device_wheels.sh" in text and '["bench/.wheels"]' in text
    assert "--quick" in text and "420" in text and "never run on a device" in text
    from bench.gpu_check import DEFAULT_BUDGET_S, PARTS

    assert DEFAULT_BUDGET_S + 100 <= 420  # no part with --quick takes much over 100 s
    names = [name for name, _ in PARTS]
    assert {"lora_engine", "nosync", "png", "graphs"} <= set(names)
    assert names.index("controlnet") > names.index("qwen_image")  # a slow device's budget cuts it first
    assert "controlnet" in text


def test_step_cache_verdicts_fail_when_the_cache_saves_nothing():
    """A cache that skips half the row-steps but runs no faster fails, one near its ideal
    passes; a per-request decision that doubles the step time, or that hits where nothing
    should, fails."""
    assert judge.step_cache_goodput(1.9, 0.5).ok
    assert not judge.step_cache_goodput(1.05, 0.5).ok
    assert not judge.step_cache_goodput(1.0, 0.0).ok  # nothing skipped: nothing shown
    assert judge.step_cache_decision(1.05, 1.0, 0).ok
    assert not judge.step_cache_decision(2.0, 1.0, 0).ok and not judge.step_cache_decision(1.0, 1.0, 3).ok


def test_controlnet_verdicts_fail_below_the_target_or_when_the_gather_saves_nothing():
    """Per-request ControlNets at 1.02× keyed groups (the CPU's figure) fail, 1.6× passes, and
    a request not served fails whatever the ratio; a mixed call that costs as much as running
    every ControlNet on every row fails, one whose ControlNets never ran shows nothing."""
    assert judge.controlnet_over_keyed(1.6, "goodput", complete=True).ok
    assert not judge.controlnet_over_keyed(1.02, "goodput", complete=True).ok
    assert not judge.controlnet_over_keyed(1.6, "goodput", complete=False).ok
    assert not judge.controlnet_over_keyed(float("nan"), "call cost", complete=True).ok
    assert judge.controlnet_gathered_cost(50.0, 55.0, 75.0).ok  # 0.2 of all-rows' extra
    assert not judge.controlnet_gathered_cost(50.0, 72.0, 75.0).ok  # the ControlNets ran on (nearly) every row
    assert not judge.controlnet_gathered_cost(50.0, 50.0, 50.0).ok  # no ControlNet ran at all
    assert not judge.controlnet_gathered_cost(0.0, 5.0, 25.0).ok


#: a CPU-sized UNet of the SD layout for the controlnet part (8×8 latents at 64², vae scale 8)
TINY_UNET_CONFIG = dict(in_channels=4, out_channels=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), block_out_channels=(32, 64),
                        layers_per_block=1, cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32)


@pytest.fixture(scope="module")
def tiny_controlnet_model():
    import torch

    from bench.gpu import controlnet as part

    return part.controlnet_model(TINY_UNET_CONFIG, "cpu", torch.float32, 64, text_tokens=8)


@pytest.mark.timeout(300)
def test_controlnet_part_on_cpu_gathers_splits_and_serves_every_system_alike(tiny_controlnet_model):
    """The controlnet part's measurements on a CPU-sized UNet: in one call each ControlNet
    ran on its own rows only (mixed and keyed) or on every row (all-rows), the keyed split
    made one call per ControlNet set, every row equals the mixed call's and the ControlNets
    moved their rows (and no other); in the burst every system served every request, with
    the same latents, keyed groups in more calls, all-rows on more ControlNet rows."""
    import torch

    from bench.gpu import controlnet as part

    model = tiny_controlnet_model
    cost = part.call_costs(model, slots=8, share=0.3, samples=1, warmup=0)
    assert cost["ran"]["mixed"] == cost["ran"]["keyed"] == {"edges": 2, "depth": 2}  # 2 of 8 requests, 2 rows each
    assert cost["ran"]["all-rows"] == {"edges": 16, "depth": 16}
    assert cost["keyed_calls"] == [12, 2, 2]
    tolerance = part.CALL_TOLERANCE[torch.float32]
    assert judge.equal_within(cost["errors"], tolerance).ok, cost["errors"]
    assert cost["effect"] > part.EFFECT_OVER_TOLERANCE * tolerance and cost["plain_rows_changed"] <= tolerance
    assert all(ms > 0 for ms in cost["ms"].values())

    trace = part.burst(8, 0.5, 1)
    using = [e for e in trace if e["controls"]]
    assert 0 < len(using) < len(trace)
    result = part.replay(model, trace, slots=8)
    results = result["results"]
    for r in results.values():
        assert r["completed"] == 8 and not r["failed"] and r["goodput"] > 0, r["system"]
    # each ControlNet request's two rows at every step, in mixed and keyed alike
    expected = 2 * sum(e["steps"] for e in using)
    assert results["mixed"]["controlnet_rows"] == results["keyed"]["controlnet_rows"] == expected
    assert results["all-rows"]["controlnet_rows"] > expected
    assert results["keyed"]["calls"] > results["mixed"]["calls"] == results["all-rows"]["calls"]
    assert result["worst_rel_l2"] <= 1e-4

    from bench.gpu import report

    before = len(report.ROWS)
    try:
        ratio = part.report_replay(result, 8, 8)
        rows = {r["metric"]: r for r in report.ROWS[before:]}
    finally:
        del report.ROWS[before:]
    assert ratio == pytest.approx(results["mixed"]["goodput"] / results["keyed"]["goodput"])
    verdict = judge.controlnet_over_keyed(ratio, "goodput", True)
    assert rows["mixed / keyed goodput"]["status"] == ("ok" if verdict.ok else "FAIL")


@pytest.mark.timeout(300)
def test_controlnet_part_judges_by_call_cost_when_the_replay_does_not_fit(tiny_controlnet_model):
    """With no time left for the trace, the part says so and judges mixed against keyed by
    the keyed split's call cost; its rows are the ones the report reads."""
    import time

    from bench.gpu import controlnet as part
    from bench.gpu import report

    before = len(report.ROWS)
    try:
        figures = part.measure(tiny_controlnet_model, 0.0, time.perf_counter(), slots=8, requests=8, samples=1)
        rows = {r["metric"]: r for r in report.ROWS[before:]}
    finally:
        del report.ROWS[before:]
    assert not figures["replayed"] and figures["over_keyed"] == figures["split_over_mixed"] > 0
    assert rows["replay"]["status"] == "skipped"
    verdict = judge.controlnet_over_keyed(figures["over_keyed"], "call cost", True)
    assert rows["mixed / keyed (call cost)"]["status"] == ("ok" if verdict.ok else "FAIL")
    assert rows["rows of keyed and all-rows vs mixed"]["status"] == "ok"
    assert rows["ControlNet rows vs a plain call (min)"]["status"] == "ok"
    assert {f"{s} median ms" for s in ("plain", "mixed", "keyed", "all-rows")} <= set(rows)
