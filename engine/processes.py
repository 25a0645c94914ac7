"""Process facts shared by the engine process, the decode arena and the test suite
(torch-free, no engine imports): one zombie-aware liveness check."""
from __future__ import annotations

import os
import pathlib


def pid_alive(pid: int) -> bool:
    """Whether a process runs under this pid (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    try:
        text = pathlib.Path(f"/proc/{pid}/stat").read_text()
        return text[text.rindex(")") + 2:].split()[0] != "Z"
    except (OSError, ValueError):
        return True
