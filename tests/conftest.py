"""Suite-wide guards: a test that leaves a child process or a shared-memory segment
behind fails, and what it left is cleaned up so the next test starts clean."""
from __future__ import annotations

import os
import pathlib
import re
import signal
import sys
import time

import pytest

from engine.transport import pid_alive

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `tests.reference` and friends import from the repo root
    sys.path.insert(0, str(ROOT))

SHM = pathlib.Path("/dev/shm")
# long-lived helpers that multiprocessing itself keeps for the whole session
_HARMLESS = ("resource_tracker", "forkserver")


def _segments() -> set[str]:
    try:
        return {p.name for p in SHM.iterdir() if "diffslot" in p.name}
    except FileNotFoundError:
        return set()


def _leaked(name: str) -> bool:
    """A segment is this run's leak when its owner (the pid in `diffslot-<pid>-...`) is
    this process or is dead; another live engine's segment on the machine is not ours."""
    match = re.match(r"diffslot-(?:test-)?(\d+)", name)
    if not match:
        return True
    pid = int(match.group(1))
    return pid == os.getpid() or not pid_alive(pid)


def _children() -> dict[int, str]:
    me, found = os.getpid(), {}
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            fields = text[text.rindex(")") + 2:].split()
            if int(fields[1]) != me or fields[0] == "Z":
                continue
            cmd = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):
            continue
        if not any(h in cmd for h in _HARMLESS):
            found[int(stat.parent.name)] = cmd.strip()
    return found


@pytest.fixture(autouse=True)
def no_leaked_processes_or_segments():
    segments_before = _segments()
    children_before = set(_children())
    yield
    deadline = time.monotonic() + 3.0
    while True:
        left = {pid: cmd for pid, cmd in _children().items() if pid not in children_before}
        new_segments = {name for name in _segments() - segments_before if _leaked(name)}
        if not left and not new_segments or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    # a killed leftover's segments now have a dead owner: they count too
    new_segments = {name for name in _segments() - segments_before if _leaked(name)}
    for name in new_segments:
        (SHM / name).unlink(missing_ok=True)
    problems = [f"process {pid} left running: {cmd[:120]}" for pid, cmd in left.items()]
    problems += [f"shared memory segment left: /dev/shm/{name}" for name in sorted(new_segments)]
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)
