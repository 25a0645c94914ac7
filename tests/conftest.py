"""Suite-wide guards, shared fixtures and the suite's layout.

The layout: every test file belongs to one or more concerns (CONCERNS below), applied as
markers registered in pytest.ini, so `pytest -m http` runs the HTTP tests; tests/README.md
says which files cover what. A file missing from CONCERNS is marked `unsorted`.

The guard: a test that leaves a child process or a shared-memory segment behind fails,
and what it left is cleaned up so the next test starts clean.

Processes are found two ways: direct children of this process, and every process
whose environment carries DIFFSLOT_TEST_OWNER=<this pid> (set here, so every
subprocess of the suite inherits it, and so do theirs: an engine's decode workers,
even once their engine is gone and they were reparented). A marked process that is
new since the test started counts unless its parent is a process that was already
there (e.g. a decode worker that a module-scoped engine respawned)."""
from __future__ import annotations

import os
import pathlib
import signal
import time

import pytest

from leak_guard import SHM, _leaked, _new_processes, _processes, _segments


@pytest.fixture(autouse=True)
def no_leaked_processes_or_segments():
    segments_before = _segments()
    processes_before = set(_processes())
    yield
    deadline = time.monotonic() + 3.0
    while True:
        left = _new_processes(processes_before)
        new_segments = {name for name in _segments() - segments_before if _leaked(name)}
        if not left and not new_segments or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass  # not our child: init reaps it
    # a killed leftover's segments now have a dead owner: they count too
    new_segments = {name for name in _segments() - segments_before if _leaked(name)}
    for name in new_segments:
        (SHM / name).unlink(missing_ok=True)
    problems = [f"process {pid} left running: {cmd[:120]}" for pid, cmd in left.items()]
    problems += [f"shared memory segment left: /dev/shm/{name}" for name in sorted(new_segments)]
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module: deterministic, and faster and steadier on a shared
    2-core machine. Use with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def triton_interpreter():
    """The suite's one Triton-interpreter worker for a module (tests/triton_interpreter.py):
    a ProcessPoolExecutor of one spawned process with TRITON_INTERPRET=1; submit
    module-level functions to it. Skips where triton is not installed."""
    pytest.importorskip("triton")
    from triton_interpreter import interpreter_pool

    with interpreter_pool() as pool:
        yield pool


# ---------------------------------------------------------------------------- the layout

# each file (relative to the repository root) → its concerns, markers registered in pytest.ini
# (tests/README.md has the table); every bench/bench_*.py is bench_smoke
CONCERNS = {
    # core: the engine core in-process (scheduler, slots, solvers, failures, bounds)
    "tests/test_core.py": ("core",),
    "tests/test_core_bounds.py": ("core",),
    "tests/test_failures.py": ("core",),
    "tests/test_interfaces.py": ("core",),
    "tests/test_previews.py": ("core", "processes"),
    "tests/test_scheduler.py": ("core",),
    "tests/test_solvers.py": ("core",),
    # models: model folders and adapters against diffusers' own pipelines
    "tests/test_controlnet.py": ("models", "processes", "http"),
    "tests/test_controlnet_sd3.py": ("models",),
    "tests/test_image_inputs.py": ("models",),
    "tests/test_image_limits.py": ("models",),
    "tests/test_ip_adapter.py": ("models",),
    "tests/test_lcm_guidance_embedding.py": ("models",),
    "tests/test_lora.py": ("models",),
    "tests/test_lora_engine.py": ("models",),
    "tests/test_model_contract.py": ("models",),
    "tests/test_pipelines.py": ("models",),
    "tests/test_sdxl_flux.py": ("models",),
    "tests/test_qwen_image.py": ("models",),
    "tests/test_shapes_controlnet.py": ("models",),
    "tests/test_shapes_dit.py": ("models",),
    "tests/test_shapes_model.py": ("models",),
    "tests/test_step_cache.py": ("models",),
    "tests/test_tiny_pipelines.py": ("models",),
    # kernels: Triton kernels (interpreter), engine._C, the GPU path's helpers on CPU
    "tests/test_atomics.py": ("kernels",),
    "tests/test_device.py": ("kernels",),
    "tests/test_gpu_check.py": ("kernels",),
    "tests/test_kernels.py": ("kernels",),
    # processes: the engine process, wire protocol, clients, decode stage, faults
    "tests/test_decode_inline.py": ("processes",),
    "tests/test_decode_workers.py": ("processes",),
    "tests/test_faults.py": ("processes",),
    "tests/test_stall.py": ("processes",),
    "tests/test_image_wire.py": ("processes",),
    "tests/test_proc.py": ("processes",),
    "tests/test_protocol.py": ("processes",),
    "tests/test_serve_bounds.py": ("processes",),
    "tests/test_step_cache_served.py": ("processes",),
    # http: the HTTP gateway and the Ray Serve app
    "tests/test_batch_api.py": ("http",),
    "tests/test_edits_http.py": ("http",),
    "tests/test_http.py": ("http",),
    "tests/test_http_bounds.py": ("http",),
    "tests/test_http_fuzz.py": ("http",),
    "tests/test_http_hostile.py": ("http",),
    "tests/test_ray_app.py": ("http",),
    # tools: the fluid queue model and its browser page
    "tests/test_fluid.py": ("tools",),
    "tests/test_queue_instrument_browser.py": ("tools",),
    # a new user's first hour: model sources, install, errors, the README's snippets, shipped adapters
    "tests/test_first_hour.py": ("models", "processes"),
    "tests/test_readme_snippets.py": ("processes", "http"),
    # bench_smoke: benchmark scripts run once, quickly
    "tests/test_bench_scripts_smoke.py": ("bench_smoke",),
    "tests/test_bench_smoke.py": ("bench_smoke",),
    "tests/test_ceiling_smoke.py": ("bench_smoke",),
    "tests/test_lora_bench_smoke.py": ("bench_smoke",),
    "tests/test_mixed_models_smoke.py": ("bench_smoke",),
    "tests/test_workload_smoke.py": ("bench_smoke",),
}
_ROOT = pathlib.Path(__file__).resolve().parent.parent


def concerns_of(path: pathlib.Path) -> tuple[str, ...]:
    try:
        relative = pathlib.Path(path).resolve().relative_to(_ROOT)
    except ValueError:
        return ("unsorted",)
    if relative.parts[0] == "bench":
        return ("bench_smoke",)
    return CONCERNS.get(relative.as_posix(), ("unsorted",))


def pytest_collection_modifyitems(config, items):
    for item in items:
        for concern in concerns_of(item.path):
            item.add_marker(concern)
