"""The rows every part writes: one printed line per check as it happens, the whole table
at the end, and the JSON file rewritten after every part."""
from __future__ import annotations

import json
import pathlib
from typing import Callable

ROWS: list[dict] = []


def _print_and_keep(r: dict) -> None:
    ROWS.append(r)
    print(f"  {r['part']:<11} {r['case']:<34} {r['metric']:<38} {fmt(r['value']):>12}  {r['status']:<7} {r['note']}",
          flush=True)


_sink: Callable[[dict], None] = _print_and_keep


def send_rows_to(sink: Callable[[dict], None]) -> None:
    """Where rows go from now on instead of the table (the interpreter's child process
    sends them to its parent on stdout)."""
    global _sink
    _sink = sink


def row(part: str, case: str, metric: str, value, status: str = "info", note: str = "") -> dict:
    """status: ok | FAIL | skipped | info."""
    r = dict(part=part, case=case, metric=metric, value=value, status=status, note=note)
    _sink(r)
    return r


def check(part: str, case: str, metric: str, value, ok: bool, note: str = "") -> bool:
    row(part, case, metric, value, "ok" if ok else "FAIL", note)
    return ok


def all_ok() -> bool:
    return all(r["status"] != "FAIL" for r in ROWS)


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def print_table() -> None:
    cols = ("part", "case", "metric", "value", "status", "note")
    cells = [[str(r["part"]), str(r["case"]), str(r["metric"]), fmt(r["value"]), r["status"], str(r["note"])]
             for r in ROWS]
    widths = [max([len(c)] + [len(x[i]) for x in cells]) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths))
    print(line)
    print("-" * len(line))
    for x in cells:
        print("  ".join(c.ljust(w) for c, w in zip(x, widths)).rstrip())


def write_json(path: pathlib.Path | None, header: dict, ok: bool, finished: bool) -> None:
    """The rows so far (after every part, so a run stopped at its time limit still leaves them)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(header, ok=ok, finished=finished, rows=ROWS), indent=1, default=str))
