"""Suite-wide guards: a test that leaves a child process or a shared-memory segment
behind fails, and what it left is cleaned up so the next test starts clean.

Processes are found two ways: direct children of this process, and every process
whose environment carries DIFFSLOT_TEST_OWNER=<this pid> (set here, so every
subprocess of the suite inherits it, and so do theirs: an engine's decode workers,
even once their engine is gone and they were reparented). A marked process that is
new since the test started counts unless its parent is a process that was already
there (e.g. a decode worker that a module-scoped engine respawned)."""
from __future__ import annotations

import os
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
