"""The suite's one way to run a Triton kernel through Triton's interpreter on CPU
(`TRITON_INTERPRET=1`); tests take it as the `triton_interpreter` fixture (tests/conftest.py).

Why a worker process. `TRITON_INTERPRET` (`triton.knobs.runtime.interpret`) is looked up
in os.environ at every access, and triton consults it at several moments: when
`@triton.jit` decorates a function (triton's own standard library at `import triton`,
the engine's kernels when engine/core/kernels.py is executed) and again at launch (e.g.
the gluon import asserts that interpreted functions only exist in interpret mode). It
must therefore be set before triton is imported and stay set for the process. In a
pytest session triton is usually imported already (anything importing engine.core
imports it), and the suite may run on a CUDA machine where other tests want the
compiled kernels, so interpreted kernels run in one spawned worker process whose
environment has TRITON_INTERPRET=1 from the start; a test builds inputs and runs the
torch reference in its own process and submits a module-level function (numpy arrays
in, numpy arrays out) to the worker.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import os

ENV = "TRITON_INTERPRET"


@contextlib.contextmanager
def interpreter_pool(start_timeout: float = 120.0):
    """One spawned worker (a ProcessPoolExecutor of 1) started with TRITON_INTERPRET=1 in
    its environment; this process's environment is left as it was. Shut down after."""
    before = os.environ.get(ENV)
    os.environ[ENV] = "1"
    pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    try:
        try:
            pool.submit(int, 0).result(timeout=start_timeout)  # start it now, inside the environment above
        finally:
            if before is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = before
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def assert_interpreted(kernel) -> None:
    """In the worker: the interpreter is on and `kernel` (a `@triton.jit` function) is
    interpreted, not compiled."""
    assert os.environ.get(ENV) == "1"
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(kernel, InterpretedFunction), type(kernel)
