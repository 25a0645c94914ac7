"""Helpers the benchmarks share: the text model they run, the engine process they start
(one environment and CPU share for every system), a timed-denoiser model wrapper, and
/proc readings. Torch-free at import time (client processes import it).

The model (`--model`): `shapes`, the embedded text-to-image model once it is a
`StableDiffusionPipeline` folder (until its weights land, a note is printed and the tiny
SD folder is used instead); `tiny-sd`, a tiny random-weight `StableDiffusionPipeline`
folder built by `engine.testing.tiny_pipelines.build_sd` (seconds, offline); or a folder.
"""
from __future__ import annotations

import os
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent

#: The prompts the benchmarks draw from: the 12 prompts `shapes` understands (R13); every
#: word is a token of the tiny SD folder's vocabulary too.
from engine.models.shapes.draw import PROMPTS  # noqa: E402,F401


def bench_model_folder(name: str, tmp: pathlib.Path) -> tuple[pathlib.Path, str]:
    """(model folder, label) for `--model`: shapes (the embedded text-to-image model),
    tiny-sd (a random-weight StableDiffusionPipeline folder built into `tmp`), or a
    diffusers folder."""
    from engine.models import resolve

    if name != "tiny-sd":
        path = resolve(name)
        return path, name if name == "shapes" else path.name
    from engine.testing.tiny_pipelines import build_sd

    folder = pathlib.Path(tmp) / "tiny-sd"
    if not (folder / "model_index.json").exists():
        build_sd(folder, seed=0)
    return folder, "tiny-sd"


def prompts_for(folder: pathlib.Path) -> list[str]:
    """The prompts a model takes: a class-conditional folder's conditions (the null one
    excluded), else `PROMPTS`."""
    import json

    conditions = pathlib.Path(folder) / "conditions.json"
    if conditions.exists() and not (pathlib.Path(folder) / "model_index.json").exists():
        return [c for c in json.loads(conditions.read_text()) if c]
    return list(PROMPTS)


def engine_env(threads: int | None) -> dict:
    """The engine process's environment: `threads` OpenMP/MKL threads (None: torch's default)."""
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    else:
        env.pop("OMP_NUM_THREADS", None)
        env.pop("MKL_NUM_THREADS", None)
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


def engine_command(address: str, engine_args: list[str], cpus: list[int] | None = None) -> list[str]:
    """`python -m engine serve --address ADDR ARGS`, optionally pinned to `cpus` (its decode
    workers inherit the mask), so that every system gets the same CPU share."""
    from frontend.launcher import serve_command

    command = serve_command(address, *engine_args)
    if not cpus:
        return command
    pin = ("import os, runpy, sys; os.sched_setaffinity(0, {%s}); sys.argv = ['engine'] + sys.argv[1:]; "
           "runpy.run_module('engine', run_name='__main__', alter_sys=True)" % ",".join(map(str, cpus)))
    return [sys.executable, "-c", pin, *command[3:]]  # command = [python, -m, engine, serve, ...]


def parse_cpus(text: str | None) -> list[int] | None:
    if not text:
        return None
    cpus = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus += list(range(int(lo), int(hi or lo) + 1))
    return cpus


class TimedDenoiser:
    """A model object that times its denoiser calls and forwards everything else to the
    model: passed to `EngineCore` in place of the model, so the core is measured as it is
    (nothing patched). `seconds` / `calls` / `rows` accumulate; `last_s` is the last call."""

    def __init__(self, model):
        self._model = model
        self.seconds, self.calls, self.rows, self.last_s = 0.0, 0, 0, 0.0

    def __getattr__(self, name):
        return getattr(self._model, name)

    def run(self, inputs):
        start = time.perf_counter()
        out = self._model.run(inputs)
        self.last_s = time.perf_counter() - start
        self.seconds += self.last_s
        self.calls += 1
        self.rows += inputs.rows
        return out

    def reset(self) -> None:
        self.seconds, self.calls, self.rows, self.last_s = 0.0, 0, 0, 0.0


# ---- /proc readings ---------------------------------------------------------------------

def proc_status_kb(pid: int, field: str) -> int | None:
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def children_of(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return kids


def cmdline(pid: int) -> bytes:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (its own, not its children's)."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def shm_leftovers(pid: int) -> list[str]:
    if not os.path.isdir("/dev/shm"):
        return []
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith(f"diffslot-{pid}-"))


def machine_line() -> str:
    import platform

    gpu = "GPU present" if os.path.exists("/dev/nvidia0") else "no GPU"
    return f"{os.cpu_count()} CPU cores, {gpu}, Python {platform.python_version()}"
