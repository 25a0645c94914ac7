"""The suite's one driver of an in-process core: call `step()` until every request has
ended, and sort what it returns by request.

Works on anything with the core's interface (`engine.core.EngineCore`, the benchmark's
baseline cores): `add_request`, `abort_requests`, `step`, `decode_done`,
`has_unfinished_requests`. Import it as the suite imports its other helpers
(`from core_driver import CoreDriver, run_to_end`; a subprocess started from the
repository root: `from tests.core_driver import ...`).

    driver = run_to_end(core, {"a": params_a, "b": params_b})
    driver.results["a"]            # a's final latents, copied when they came out
    driver.finished["a"].timings   # the DenoiseFinished itself

What differs between tests is a parameter, not another loop: when finished latents
are acknowledged (`auto_decode`), how they are kept (`keep`), deferred fences released
before each step (`release`), a failure raising at once (`fail_on_error`), hooks before
and after each step (`before_step`, `after_step`: free-slot poisoning, late joins,
cancels, counters), arrivals and cancels at given step() calls, and a bound on the
number of calls.
"""
from __future__ import annotations

import collections
from typing import Callable, Iterable, Mapping

from engine.core import DenoiseFinished, RequestCanceled, RequestFailed, StepProgress
from engine.core.outputs import PreviewReady

KEEPS = ("numpy", "torch", None)


def _pairs(requests) -> Iterable[tuple]:
    return requests.items() if isinstance(requests, Mapping) else requests


class CoreDriver:
    """Steps `core` and records its outputs: `finished` (request id → DenoiseFinished),
    `results` (request id → its latents as `keep` says, copied as they came out, before
    the output buffer could be reused), `canceled` (id → RequestCanceled), `failed` (id →
    the error string), `progress` (id → the steps reported by StepProgress, in order),
    `previews` (every PreviewReady, in order), `served` (per step() call, the ids that
    had a StepProgress) and `calls` (step() calls so far).

    - `auto_decode`: acknowledge each DenoiseFinished with `decode_done` at once (it must
      answer True: deliver); off, the test calls `decode_done` itself.
    - `keep`: "numpy" (`latents.numpy().copy()`), "torch" (`latents.clone()`) or None
      (no copy in `results`; `finished` has the output as it came).
    - `release`: release every deferred fence (`core.fences.release_all()`) before each
      step; an attribute, so a test can switch it on mid-way.
    - `fail_on_error`: a RequestFailed raises AssertionError at once instead of being
      kept in `failed`.
    - `previews`: False makes a PreviewReady fail (a test that asked for none).
    - `before_step(driver)`: called before every step() (poisoning, joins, cancels).
    - `after_step(driver, outputs)`: called right after `core.step()` returns, before
      the driver acknowledges anything (the core still as step() left it).

    Every output is checked against the ones before it: a request ends once (finished or
    canceled), and reports no progress after its end."""

    def __init__(self, core, *, auto_decode: bool = True, keep: str | None = "numpy", release: bool = False,
                 fail_on_error: bool = False, previews: bool = True,
                 before_step: Callable[["CoreDriver"], None] | None = None,
                 after_step: Callable[["CoreDriver", list], None] | None = None):
        assert keep in KEEPS, keep
        self.core, self.auto_decode, self.keep, self.release = core, auto_decode, keep, release
        self.fail_on_error, self.allow_previews = fail_on_error, previews
        self.before_step, self.after_step = before_step, after_step
        self.finished: dict[str, DenoiseFinished] = {}
        self.results: dict = {}
        self.canceled: dict[str, RequestCanceled] = {}
        self.failed: dict[str, str] = {}
        self.progress: dict[str, list[int]] = collections.defaultdict(list)
        self.previews: list[PreviewReady] = []
        self.served: list[set[str]] = []
        self.calls = 0

    def add(self, requests) -> "CoreDriver":
        """Add requests now: {id: params} or (id, params) pairs, in their order."""
        for rid, params in _pairs(requests):
            self.core.add_request(rid, params)
        return self

    def step(self) -> list:
        """One `core.step()`; its outputs sorted into the driver's records and returned."""
        if self.before_step is not None:
            self.before_step(self)
        if self.release:
            self.core.fences.release_all()
        outputs = self.core.step()
        self.calls += 1
        if self.after_step is not None:
            self.after_step(self, outputs)
        served = set()
        for o in outputs:
            rid = o.request_id
            if isinstance(o, StepProgress):
                assert rid not in self.canceled and rid not in self.finished, f"{rid}: progress after its end"
                self.progress[rid].append(o.step)
                served.add(rid)
            elif isinstance(o, DenoiseFinished):
                assert rid not in self.finished and rid not in self.canceled, f"{rid} ended twice"
                self.finished[rid] = o
                if self.keep == "numpy":
                    self.results[rid] = o.latents.numpy().copy()
                elif self.keep == "torch":
                    self.results[rid] = o.latents.clone()
                if self.auto_decode:
                    assert self.core.decode_done(rid) is True, f"{rid}: decode_done dropped a finished request"
            elif isinstance(o, RequestCanceled):
                assert rid not in self.canceled, f"{rid} canceled twice"
                self.canceled[rid] = o
            elif isinstance(o, RequestFailed):
                if self.fail_on_error:
                    raise AssertionError(f"{rid} failed: {o.error}")
                self.failed[rid] = o.error
            elif isinstance(o, PreviewReady) and self.allow_previews:
                self.previews.append(o)
            else:
                raise AssertionError(f"unexpected output {o!r}")
        self.served.append(served)
        return outputs

    def run(self, requests=None, *, arrivals: Mapping | None = None, cancels: Mapping | None = None,
            waiting: Callable[[], bool] | None = None, limit: int = 10_000) -> "CoreDriver":
        """Add `requests` now, then step until every request has ended.

        `arrivals[k]`: (id, params) pairs added, `cancels[k]`: ids canceled, before step()
        call k (counted by `calls`, from the driver's first call). `waiting()`: true while
        a `before_step` hook still has requests to add. More than `limit` step() calls in
        this run fail (a core that makes no progress)."""
        if requests is not None:
            self.add(requests)
        arrivals, cancels = arrivals or {}, cancels or {}
        last = max([*arrivals, *cancels], default=-1)

        def more() -> bool:
            return self.calls <= last or (waiting is not None and waiting()) or self.core.has_unfinished_requests()

        for _ in range(limit):
            if not more():
                return self
            self.add(arrivals.get(self.calls, ()))
            if cancels.get(self.calls):
                self.core.abort_requests(list(cancels[self.calls]))
            self.step()
        assert not more(), f"not done after {limit} step() calls: the core made no progress"
        return self


def run_to_end(core, requests=None, *, arrivals: Mapping | None = None, cancels: Mapping | None = None,
               waiting: Callable[[], bool] | None = None, limit: int = 10_000, **driver) -> CoreDriver:
    """A fresh `CoreDriver(core, **driver)` run until every request has ended; returned
    for its records (`.results`, `.finished`, `.canceled`, `.failed`, ...)."""
    return CoreDriver(core, **driver).run(requests, arrivals=arrivals, cancels=cancels, waiting=waiting,
                                          limit=limit)
