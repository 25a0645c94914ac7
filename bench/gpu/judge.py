"""The verdicts of gpu_check's device checks, apart from their measurements (torch-free):
each takes what a part measured and says whether it passes, against a target stated
here, so a CPU test (tests/test_gpu_check.py) can hand each one a broken measurement and
see it fail. None of these targets has been met on a device yet: no device has run them.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Callable, Sequence

#: the update kernel's bandwidth at least this fraction of a device-to-device copy of the
#: same bytes on the same device (a streaming kernel near the memory bound)
BANDWIDTH_TARGET = 0.85

#: an engine at full batch, run to the end, at least this fraction of its denoiser's peak
#: batched rate (useful rows/s): the host runs ahead of the device, so what is left is the
#: fused update, the uploads and the first and last steps
THROUGHPUT_TARGETS = {"unet": 0.85, "sdxl": 0.9, "flux": 0.9}

#: PNG outputs through the in-process decode stage at least this fraction of latent
#: outputs' steady-state goodput (the decode runs beside the denoiser on its own stream)
PNG_TARGET = 0.9

#: the completions a steady-state rate leaves out at each end (the start-up and the decode tail)
STEADY_TRIM = 0.25

#: a held launch must outlast this many of the engine's measured steps: the reaper's
#: checks look at the pending fence over a few step() calls
HOLD_STEPS = 10
MIN_HOLD_S = 0.2


#: step caches with a set skip pattern: goodput at least this fraction of the ideal
#: 1 / (1 − share of row-steps skipped) (the part outside the blocks, the gather and the
#: scatter cost the rest); the per-request first-block decision, when nothing is skipped,
#: at most this multiple of the uncached time
STEP_CACHE_OF_IDEAL = 0.8
STEP_CACHE_DECISION_COST = 1.15

#: per-request ControlNets (each on the rows that use it, in one call) against groups keyed
#: by ControlNet (requests share a call only with the same ControlNets): goodput at least
#: this multiple of the keyed groups' on the same trace; it presumes a device where a small
#: call costs about what a full one does (a CPU call's cost grows with its rows)
CONTROLNET_OVER_KEYED = 1.5
#: the gathered ControlNet sub-batches' cost beyond a plain call at most this fraction of
#: what running every ControlNet on every row costs beyond it (rows that do not use one pay
#: nothing; with 5 of 16 requests on one of two ControlNets the rows' own share is 10/64)
CONTROLNET_GATHERED_SHARE = 0.5


@dataclasses.dataclass(frozen=True)
class Verdict:
    ok: bool
    note: str = ""


def bandwidth(kernel_gb_s: float, copy_gb_s: float, finite: bool) -> Verdict:
    ratio = kernel_gb_s / copy_gb_s if copy_gb_s > 0 else 0.0
    ok = finite and ratio >= BANDWIDTH_TARGET
    return Verdict(ok, f"target ≥ {BANDWIDTH_TARGET:g} of the copy's {copy_gb_s:.0f} GB/s"
                   + ("" if finite else "; latents went non-finite"))


def throughput(part: str, useful_rows_s: float, peak_rows_s: float, finished: int, expected: int,
               failed: int) -> Verdict:
    target = THROUGHPUT_TARGETS[part]
    ratio = useful_rows_s / peak_rows_s if peak_rows_s > 0 else 0.0
    ok = ratio >= target and finished == expected and failed == 0 and useful_rows_s > 0
    return Verdict(ok, f"target ≥ {target:g}; {finished}/{expected} finished, {failed} failed")


def graph_replays(graphs: int, replays: int, replays_at_start: int, calls: int) -> Verdict:
    """Every denoiser call while serving replayed a graph: the replays counted after the
    start-up captures (each of which replays once) cover the calls."""
    served = replays - replays_at_start
    ok = graphs > 0 and calls > 0 and served >= calls
    return Verdict(ok, f"{served} replays while serving for {calls} denoiser calls "
                   f"({replays_at_start} at start-up capture, not counted)")


def steady_rate(completed_at: Sequence[float], trim: float = STEADY_TRIM) -> float:
    """Completions per second between the completion at the `trim` quantile and the one at
    `1 - trim` (the start-up before, the tail of the last decodes after, left out)."""
    times = sorted(completed_at)
    if len(times) < 4:
        return 0.0
    first, last = int(trim * (len(times) - 1)), int(round((1 - trim) * (len(times) - 1)))
    span = times[last] - times[first]
    return (last - first) / span if span > 0 else 0.0


def png_goodput(latent_completed_at: Sequence[float], png_completed_at: Sequence[float], expected: int,
                errors: int) -> tuple[float, Verdict]:
    """(steady PNG / latent goodput, its verdict)."""
    latent, png = steady_rate(latent_completed_at), steady_rate(png_completed_at)
    ratio = png / latent if latent > 0 else 0.0
    ok = ratio >= PNG_TARGET and len(png_completed_at) == len(latent_completed_at) == expected and errors == 0
    return ratio, Verdict(ok, f"target ≥ {PNG_TARGET:g}, steady state (middle {1 - 2 * STEADY_TRIM:.0%} of "
                              f"completions): latent {latent:.2f}/s, png {png:.2f}/s")


def hold_seconds(step_s: float) -> float:
    """How long to hold the stream for the reaper's checks, from the measured step time."""
    return max(MIN_HOLD_S, HOLD_STEPS * step_s)


def reaper_hold(hold_s: float, step_s: float) -> Verdict:
    """The hold (timed by CUDA events) outlasted `HOLD_STEPS` measured steps."""
    need = HOLD_STEPS * step_s
    return Verdict(hold_s >= need and hold_s > 0, f"needs ≥ {HOLD_STEPS} steps of {step_s * 1e3:.2f} ms "
                   f"= {need * 1e3:.0f} ms for the checks to look at a pending fence")


#: with the stream held, a step() that synchronises nothing returns within this fraction of the hold
HELD_STEP_FRACTION = 0.25
MIN_MEASURED_HOLD_S = 0.1


def held_step(host_s: float, held_s: float, ok: bool = True) -> Verdict:
    """A step() run while the stream was held for `held_s` (CUDA events) came back long
    before the hold ended: nothing in it waited for the device."""
    passed = ok and held_s >= MIN_MEASURED_HOLD_S and host_s < HELD_STEP_FRACTION * held_s
    return Verdict(passed, f"host {host_s * 1e3:.1f} ms, hold {held_s * 1e3:.0f} ms by events; "
                           f"target < {HELD_STEP_FRACTION:g} of the hold")


def first_sync(step: Callable[[], object], set_mode: Callable[[object], None]) -> str | None:
    """Run `step` with torch's sync debug mode at "error" (`set_mode`:
    `torch.cuda.set_sync_debug_mode`): the first line of the synchronising call's error,
    or None when it ran without one. Other errors propagate; the mode is off after."""
    set_mode("error")
    try:
        step()
    except RuntimeError as exc:
        if "synchroniz" not in str(exc).lower():
            raise
        return str(exc).strip().splitlines()[0]
    finally:
        set_mode(0)
    return None


def sync_free(syncs: Sequence[str], steps: int) -> Verdict:
    ok = not syncs and steps > 0
    return Verdict(ok, f"{steps} steps under set_sync_debug_mode('error')"
                   + (f"; first: {syncs[0][:140]}" if syncs else ""))


def equal_within(errors: dict, tolerance: float) -> Verdict:
    """Every result's error within the tolerance (and at least one result)."""
    worst = max(errors.values(), default=float("inf"))
    return Verdict(bool(errors) and worst <= tolerance,
                   f"tol {tolerance:g} over {len(errors)} results" + (f", worst {worst:.3g}" if errors else ""))


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def step_cache_goodput(speedup: float, skipped_share: float) -> Verdict:
    """A cache that skips `skipped_share` of the row-steps comes within STEP_CACHE_OF_IDEAL of
    its ideal speed-up; one that skips nothing shows nothing."""
    ideal = 1.0 / max(1e-9, 1.0 - skipped_share)
    ok = skipped_share > 0 and speedup >= STEP_CACHE_OF_IDEAL * ideal
    return Verdict(ok, f"{skipped_share:.2f} of row-steps skipped: ideal {ideal:.2f}×, "
                   f"target ≥ {STEP_CACHE_OF_IDEAL:g} × ideal")


def step_cache_decision(seconds_deciding: float, seconds_plain: float, hits: int) -> Verdict:
    """Deciding per request (the first block apart, one host read a call) when nothing is
    skipped costs at most STEP_CACHE_DECISION_COST × the uncached time."""
    ok = hits == 0 and seconds_plain > 0 and seconds_deciding <= STEP_CACHE_DECISION_COST * seconds_plain
    return Verdict(ok, f"target ≤ {STEP_CACHE_DECISION_COST:g}× uncached; {hits} hits (0 expected)")


def controlnet_over_keyed(ratio: float, measured_by: str, complete: bool) -> Verdict:
    """Per-request ControlNets at least CONTROLNET_OVER_KEYED × ControlNet-keyed groups:
    `ratio` mixed / keyed goodput on one trace (or, where no trace ran, the keyed split's
    cost over the mixed call's for the same rows, `measured_by` says which), every request
    of every system served (`complete`)."""
    ok = complete and ratio >= CONTROLNET_OVER_KEYED  # False for NaN
    return Verdict(ok, f"target ≥ {CONTROLNET_OVER_KEYED:g}× keyed groups, by {measured_by}"
                   + ("" if complete else "; a request was not served"))


def controlnet_gathered_cost(plain_ms: float, mixed_ms: float, all_rows_ms: float) -> Verdict:
    """The mixed call (each ControlNet on its own rows) costs beyond a plain call at most
    CONTROLNET_GATHERED_SHARE of what every ControlNet on every row costs beyond it; the
    all-rows call must cost more than a plain one (else no ControlNet ran: nothing shown)."""
    extra_all = all_rows_ms - plain_ms
    share = (mixed_ms - plain_ms) / extra_all if extra_all > 0 else float("inf")
    ok = plain_ms > 0 and extra_all > 0 and share <= CONTROLNET_GATHERED_SHARE
    return Verdict(ok, f"plain {plain_ms:.2f} ms, mixed {mixed_ms:.2f} ms, all-rows {all_rows_ms:.2f} ms: mixed's "
                   f"extra {share:.2f} of all-rows' (target ≤ {CONTROLNET_GATHERED_SHARE:g})")
