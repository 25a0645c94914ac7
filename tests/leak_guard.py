"""Finding what a test left behind: processes (children, and every process marked as
started by this test session, grandchildren included) and shared-memory segments. The
suite's guard in conftest.py uses it, and so does the test that checks the guard (a
module of its own: `import conftest` may find bench/conftest.py when both are collected)."""
from __future__ import annotations

import os
import pathlib
import re

from engine.processes import pid_alive
from engine.protocol import SEGMENT_PREFIX

SHM = pathlib.Path("/dev/shm")
# long-lived helpers that multiprocessing itself keeps for the whole session
_HARMLESS = ("resource_tracker", "forkserver")
OWNER_ENV = "DIFFSLOT_TEST_OWNER"
os.environ[OWNER_ENV] = str(os.getpid())
_MARK = f"{OWNER_ENV}={os.getpid()}".encode()


def _segments() -> set[str]:
    try:
        return {p.name for p in SHM.iterdir() if "diffslot" in p.name}
    except FileNotFoundError:
        return set()


def _leaked(name: str) -> bool:
    """A segment is this run's leak when its owner (the pid in `diffslot-<pid>-...`) is
    this process or is dead; another live engine's segment on the machine is not ours."""
    match = re.match(rf"{re.escape(SEGMENT_PREFIX)}(?:test-)?(\d+)", name)
    if not match:
        return True
    pid = int(match.group(1))
    return pid == os.getpid() or not pid_alive(pid)


def _processes() -> dict[int, tuple[int, str]]:
    """pid → (parent pid, command line) of this process's children and of every live
    process marked as started by this test session (grandchildren included)."""
    me, found = os.getpid(), {}
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            pid = int(stat.parent.name)
            if pid == me:
                continue
            text = stat.read_text()
            fields = text[text.rindex(")") + 2:].split()
            if fields[0] == "Z":
                continue
            ppid = int(fields[1])
            if ppid != me:
                environ = (stat.parent / "environ").read_bytes()
                if _MARK not in environ.split(b"\0"):
                    continue
            cmd = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):
            continue
        if not any(h in cmd for h in _HARMLESS):
            found[pid] = (ppid, cmd.strip())
    return found


def _children() -> dict[int, str]:
    """Direct children (kept for tests that ask)."""
    return {pid: cmd for pid, (ppid, cmd) in _processes().items() if ppid == os.getpid()}


def _new_processes(before: set[int]) -> dict[int, str]:
    me = os.getpid()
    return {pid: cmd for pid, (ppid, cmd) in _processes().items()
            if pid not in before and (ppid == me or ppid not in before)}
