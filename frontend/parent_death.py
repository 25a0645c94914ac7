"""Start a command that is signalled when the thread that started it exits.

    python -I frontend/parent_death.py PARENT_PID SIGNAL COMMAND [ARG ...]

Linux's PR_SET_PDEATHSIG, set in a fresh single-threaded interpreter that then
`exec`s COMMAND (the setting survives exec), so the starting process needs no
`preexec_fn`, which is unsafe in a process with threads (a Ray replica has many: a
child forked while another thread holds a lock can deadlock before it execs). If
PARENT_PID is no longer the parent when the signal is armed, the parent died in
between: the command is not started at all. Off Linux the command just runs.

`frontend.ray_app` starts each replica's engine this way with SIGINT, which stops an
engine at once (SIGTERM would make it drain for its drain timeout, holding the GPU
while Ray starts the replica's replacement). Run as a script, not with `-m`: it
imports nothing of this package, so it adds only an interpreter start.
"""
from __future__ import annotations

import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def command(argv: list[str], signum: int = signal.SIGINT) -> list[str]:
    """`argv` wrapped so that it gets `signum` when the calling thread exits. Start it
    from a thread that lives as long as the child should (PDEATHSIG follows the thread
    that forked, not the process)."""
    # -I: this script's folder (which holds a package named `http`) stays off sys.path
    return [sys.executable, "-I", os.path.abspath(__file__), str(os.getpid()), str(int(signum)), *argv]


def main(args: list[str]) -> int:
    if len(args) < 3:
        print("usage: parent_death.py PARENT_PID SIGNAL COMMAND [ARG ...]", file=sys.stderr)
        return 2
    parent, signum, argv = int(args[0]), int(args[1]), args[2:]
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
            print(f"parent_death: prctl failed (errno {ctypes.get_errno()})", file=sys.stderr)
            return 1
        if os.getppid() != parent:  # the parent is already gone: do not start an orphan
            return 1
    os.execvp(argv[0], argv)
    return 1  # not reached: exec replaces this process or raises


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
