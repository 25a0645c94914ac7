"""Tests for engine._C: 64-bit atomics and futex wait/wake on shared buffers.

Cross-process tests use the "spawn" start method and named SharedMemory
segments; every process started is joined (or killed) and every segment is
closed and unlinked, whatever the outcome.
"""

from __future__ import annotations

import contextlib
import mmap
import multiprocessing as mp
import os
import secrets
import signal
import struct
import sys
import threading
import time
from multiprocessing.shared_memory import SharedMemory

import pytest

from engine import _C as C

try:  # numpy is a project dependency, but these tests do not require it
    import numpy as np
except ImportError:  # pragma: no cover
    np = None

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)

SPAWN = mp.get_context("spawn")

# Layout of the words used by the cross-process tests (byte offsets).
VALUE = 0  # the word under test
READY = 8  # children count themselves in here
GO = 16  # start gate: children wait for it to become 1
RESULT = 24  # per-child results start here, one word per child (up to 4)
CONTENTION = 56  # contention seen by the increment workers, all together
SEEN = 64  # per-child observed values start here
ELAPSED = 128  # per-child wait durations (nanoseconds) start here

CHILD_TIMEOUT = 30.0  # no child waits longer than this for anything

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="futexes are Linux-only")


# --------------------------------------------------------------------------- #
# Helpers                                                                      #
# --------------------------------------------------------------------------- #


@contextlib.contextmanager
def shared_segment(size: int = 4096):
    """A fresh named SharedMemory segment, closed and unlinked on exit."""
    name = f"diffslot-test-{os.getpid()}-{secrets.token_hex(6)}"
    shm = SharedMemory(name=name, create=True, size=size)
    try:
        yield shm
    finally:
        try:
            shm.close()
        finally:
            shm.unlink()


@contextlib.contextmanager
def child_processes():
    """Collects started processes; joins them, killing any still alive, on exit."""
    procs: list = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.pid is None:  # never started
                continue
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
            if not p.is_alive():
                p.close()


def start(procs: list, target, *args):
    p = SPAWN.Process(target=target, args=args, daemon=True)
    procs.append(p)
    p.start()
    return p


def join_all(procs: list, timeout: float = 45.0) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    alive = [p.pid for p in procs if p.is_alive()]
    assert not alive, f"child processes {alive} did not finish in {timeout}s"
    codes = [p.exitcode for p in procs]
    assert codes == [0] * len(procs), f"child exit codes {codes}"


def wait_for_value(buf, offset: int, target: int, timeout: float = CHILD_TIMEOUT) -> None:
    """Block (via C.wait) until the word at offset equals target."""
    deadline = time.monotonic() + timeout
    while True:
        v = C.load(buf, offset)
        if v == target:
            return
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"word at {offset} is {v}, expected {target} within {timeout}s"
        C.wait(buf, offset, v, timeout=min(remaining, 0.5))


def wake_until_blocked(buf, offset: int, waiters: int, n=None, timeout: float = CHILD_TIMEOUT) -> None:
    """Call wake() on an unchanged word until it reports `waiters` woken at once.

    Proves the waiters are really asleep in the kernel; since the value does
    not change, each of them must go back to sleep rather than return.
    """
    deadline = time.monotonic() + timeout
    while True:
        woken = C.wake(buf, offset, n)
        limit = waiters if n is None else min(n, waiters)
        assert 0 <= woken <= limit, f"wake reported {woken} woken with only {limit} possible"
        if woken == limit:
            return
        assert time.monotonic() < deadline, f"waiters never all blocked (last wake woke {woken})"
        time.sleep(0.02)


def assert_released(obj) -> None:
    """Fail if a buffer export of obj leaked (it could not be resized/closed)."""
    if isinstance(obj, bytearray):
        obj.extend(b"\0" * 8)  # BufferError if an export is still held
        del obj[-8:]
    elif isinstance(obj, mmap.mmap):
        obj.close()  # BufferError if an export is still held
    else:  # pragma: no cover
        raise TypeError(type(obj))


# --------------------------------------------------------------------------- #
# Child process bodies (module level so "spawn" can import them)              #
# --------------------------------------------------------------------------- #


def _gate(buf) -> None:
    """Count in on READY, then wait for the parent to open GO."""
    C.fetch_add(buf, READY, 1)
    C.wake(buf, READY)
    if not C.wait(buf, GO, 0, timeout=CHILD_TIMEOUT) and C.load(buf, GO) == 0:
        raise TimeoutError("start gate never opened")


# The contended-increment workers run in chunks until each has done at least
# MIN_ITERATIONS increments and together they have seen CONTENTION_TARGET signs
# of another process touching the word in between (or CONTENTION_SECONDS
# pass).  A wrong, non-atomic implementation only loses updates when the
# processes interleave inside an operation; on a loaded machine that takes
# longer, so the loop keeps going instead of relying on a fixed count.  Each
# worker reports the increments it did (RESULT) and the contention it saw (SEEN).
MIN_ITERATIONS = 50_000
CONTENTION_TARGET = 20_000
CONTENTION_SECONDS = 5.0
CHUNK = 1_000


def _keep_going(buf, done: int, deadline: float) -> bool:
    if done < MIN_ITERATIONS:
        return True
    return C.load(buf, CONTENTION) < CONTENTION_TARGET and time.monotonic() < deadline


def _fetch_add_worker(name: str, index: int) -> None:
    shm = SharedMemory(name=name)
    try:
        buf = shm.buf
        _gate(buf)
        deadline = time.monotonic() + CONTENTION_SECONDS
        last = C.fetch_add(buf, VALUE, 1)
        done, contention = 1, 0
        while _keep_going(buf, done, deadline):
            gaps = 0
            for _ in range(CHUNK):
                old = C.fetch_add(buf, VALUE, 1)
                # Within one process the returned old values strictly increase;
                # a gap means another process incremented in between.
                if old <= last:
                    raise AssertionError(f"fetch_add returned {old} after {last}")
                if old != last + 1:
                    gaps += 1
                last = old
            done += CHUNK
            contention += gaps
            C.fetch_add(buf, CONTENTION, gaps)
        C.store(buf, RESULT + 8 * index, done)
        C.store(buf, SEEN + 8 * index, contention)
        del buf
    finally:
        shm.close()


def _cas_worker(name: str, index: int) -> None:
    shm = SharedMemory(name=name)
    try:
        buf = shm.buf
        _gate(buf)
        deadline = time.monotonic() + CONTENTION_SECONDS
        done = contention = 0
        while _keep_going(buf, done, deadline):
            retries = 0
            for _ in range(CHUNK):
                old = C.load(buf, VALUE)
                while True:
                    ok, seen = C.compare_exchange(buf, VALUE, old, old + 1)
                    if ok:
                        if seen != old:
                            raise AssertionError(f"successful CAS observed {seen}, expected {old}")
                        break
                    if seen == old:
                        raise AssertionError("failed CAS observed the expected value")
                    retries += 1  # another process got in between load and CAS
                    old = seen
            done += CHUNK
            contention += retries
            C.fetch_add(buf, CONTENTION, retries)
        C.store(buf, RESULT + 8 * index, done)
        C.store(buf, SEEN + 8 * index, contention)
        del buf
    finally:
        shm.close()


def _waiter(name: str, expected: int, index: int, timeout: float = CHILD_TIMEOUT) -> None:
    """Wait on VALUE != expected; report 1 (woken) / 2 (timed out), the value and the time taken."""
    shm = SharedMemory(name=name)
    try:
        buf = shm.buf
        C.fetch_add(buf, READY, 1)
        C.wake(buf, READY)
        t0 = time.monotonic_ns()
        woke = C.wait(buf, VALUE, expected, timeout=timeout)
        C.store(buf, ELAPSED + 8 * index, time.monotonic_ns() - t0)
        C.store(buf, SEEN + 8 * index, C.load(buf, VALUE))
        C.store(buf, RESULT + 8 * index, 1 if woke else 2)
        C.wake(buf, RESULT + 8 * index)
        del buf
    finally:
        shm.close()


def _interruptible_waiter(name: str) -> None:
    """Wait forever on VALUE == 0; report 3 if interrupted by KeyboardInterrupt."""
    shm = SharedMemory(name=name)
    try:
        buf = shm.buf
        # Behave like an interactive process even if started with SIGINT ignored.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            C.store(buf, READY, 1)
            C.wake(buf, READY)
            C.wait(buf, VALUE, 0)  # no timeout
            C.store(buf, RESULT, 4)  # must not get here: nobody changes VALUE
        except KeyboardInterrupt:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            C.store(buf, RESULT, 3)
            C.wake(buf, RESULT)
        del buf
    finally:
        shm.close()


# --------------------------------------------------------------------------- #
# Single-process semantics                                                    #
# --------------------------------------------------------------------------- #

BUFFER_KINDS = ["bytearray", "mmap", "memoryview", "shared_memory"] + (["numpy"] if np is not None else [])


@pytest.fixture(params=BUFFER_KINDS)
def buf(request):
    kind = request.param
    if kind == "bytearray":
        yield bytearray(64)
    elif kind == "memoryview":
        backing = bytearray(64)
        with memoryview(backing) as mv:
            yield mv
    elif kind == "mmap":
        mm = mmap.mmap(-1, 4096)
        try:
            yield mm
        finally:
            mm.close()
    elif kind == "numpy":
        yield np.zeros(8, dtype=np.int64)
    elif kind == "shared_memory":
        with shared_segment() as shm:
            mv = shm.buf
            try:
                yield mv
            finally:
                mv.release()
    else:  # pragma: no cover
        raise AssertionError(kind)


def raw(buf, offset: int) -> int:
    return struct.unpack_from("=q", buf, offset)[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", [0, 1, -1, 42, -42, 2**32, 2**32 - 1, -(2**32), INT64_MAX, INT64_MIN, 0x0102030405060708])
def test_store_load_roundtrip(buf, value):
    C.store(buf, 8, value)
    assert C.load(buf, 8) == value
    # The word is a native-endian int64, visible as such to struct/numpy.
    assert raw(buf, 8) == value
    # Neighbouring words are untouched.
    assert raw(buf, 0) == 0
    assert raw(buf, 16) == 0


@pytest.mark.timeout(60)
def test_load_sees_plain_writes(buf):
    struct.pack_into("=q", buf, 24, -123456789012345)
    assert C.load(buf, 24) == -123456789012345
    assert C.load(buf, 0) == 0


@pytest.mark.timeout(60)
def test_numpy_element_view():
    if np is None:
        pytest.skip("numpy not installed")
    arr = np.zeros(4, dtype=np.int64)
    C.store(arr, 16, -7)
    assert arr[2] == -7
    arr[3] = INT64_MIN
    assert C.load(arr, 24) == INT64_MIN
    assert C.fetch_add(arr, 24, -1) == INT64_MIN
    assert arr[3] == INT64_MAX


@pytest.mark.timeout(60)
def test_fetch_add(buf):
    C.store(buf, 0, 10)
    assert C.fetch_add(buf, 0, 5) == 10
    assert C.load(buf, 0) == 15
    assert C.fetch_add(buf, 0, -20) == 15
    assert C.load(buf, 0) == -5
    assert C.fetch_add(buf, 0, 0) == -5
    assert C.load(buf, 0) == -5
    # Crossing the 32-bit boundary carries into the high half.
    C.store(buf, 0, 2**32 - 1)
    assert C.fetch_add(buf, 0, 1) == 2**32 - 1
    assert C.load(buf, 0) == 2**32
    assert C.fetch_add(buf, 0, -1) == 2**32
    assert C.load(buf, 0) == 2**32 - 1


@pytest.mark.timeout(60)
def test_fetch_add_wraps_around(buf):
    C.store(buf, 0, INT64_MAX)
    assert C.fetch_add(buf, 0, 1) == INT64_MAX
    assert C.load(buf, 0) == INT64_MIN
    assert C.fetch_add(buf, 0, -1) == INT64_MIN
    assert C.load(buf, 0) == INT64_MAX
    C.store(buf, 0, -1)
    assert C.fetch_add(buf, 0, INT64_MIN) == -1
    assert C.load(buf, 0) == INT64_MAX
    C.store(buf, 0, INT64_MAX)
    assert C.fetch_add(buf, 0, INT64_MAX) == INT64_MAX
    assert C.load(buf, 0) == -2


@pytest.mark.timeout(60)
def test_compare_exchange(buf):
    C.store(buf, 16, 5)
    assert C.compare_exchange(buf, 16, 5, -9) == (True, 5)
    assert C.load(buf, 16) == -9
    # Failure leaves the word alone and reports what it held.
    assert C.compare_exchange(buf, 16, 5, 100) == (False, -9)
    assert C.load(buf, 16) == -9
    result = C.compare_exchange(buf, 16, -9, INT64_MIN)
    assert isinstance(result, tuple) and result == (True, -9)
    assert type(result[0]) is bool
    assert C.compare_exchange(buf, 16, INT64_MIN, INT64_MAX) == (True, INT64_MIN)
    assert C.load(buf, 16) == INT64_MAX
    # The full 64 bits are compared, not just the low half.
    C.store(buf, 16, 2**32 + 7)
    assert C.compare_exchange(buf, 16, 7, 0) == (False, 2**32 + 7)
    assert C.load(buf, 16) == 2**32 + 7


@pytest.mark.timeout(60)
def test_offsets_are_independent(buf):
    for i in range(4):
        C.store(buf, 8 * i, 1000 + i)
    C.fetch_add(buf, 8, 5)
    C.compare_exchange(buf, 16, 1002, -1)
    assert [C.load(buf, 8 * i) for i in range(4)] == [1000, 1006, -1, 1003]


@pytest.mark.timeout(60)
def test_last_word_in_buffer():
    b = bytearray(24)
    C.store(b, 16, -3)
    assert C.load(b, 16) == -3
    assert b[16:] == struct.pack("=q", -3)


@pytest.mark.timeout(60)
def test_wait_returns_immediately_when_value_differs(buf):
    C.store(buf, 0, 7)
    t0 = time.monotonic()
    assert C.wait(buf, 0, 6) is True  # no timeout: would hang if it slept
    assert C.wait(buf, 0, 6, timeout=30) is True
    assert C.wait(buf, 0, 6, timeout=0) is True
    # Differs only in the high half: the full 64-bit value is compared.
    assert C.wait(buf, 0, 7 + 2**32, timeout=30) is True
    assert C.wait(buf, 0, 7 - 2**32) is True
    assert time.monotonic() - t0 < 5


@pytest.mark.timeout(60)
def test_wait_zero_timeout_on_equal_value(buf):
    C.store(buf, 0, -1)
    assert C.wait(buf, 0, -1, timeout=0) is False
    assert C.wait(buf, 0, -1, timeout=0.0) is False


@pytest.mark.timeout(60)
@pytest.mark.parametrize("timeout", [0.3, 1])
def test_wait_times_out(timeout):
    with shared_segment() as shm:
        mv = shm.buf
        try:
            C.store(mv, 8, 99)
            t0 = time.monotonic()
            assert C.wait(mv, 8, 99, timeout=timeout) is False
            elapsed = time.monotonic() - t0
            assert timeout - 0.02 <= elapsed < 10
            assert C.load(mv, 8) == 99
        finally:
            mv.release()


@pytest.mark.timeout(60)
def test_wake_without_waiters(buf):
    assert C.wake(buf, 0) == 0
    assert C.wake(buf, 0, 1) == 0
    assert C.wake(buf, 0, n=0) == 0
    assert C.wake(buf, 8, n=None) == 0
    assert C.wake(buf, 8, n=2**70) == 0  # clamped, not an error


@pytest.mark.timeout(60)
def test_wait_releases_gil_and_is_woken_by_thread():
    b = bytearray(16)
    result = {}

    def waiter():
        t0 = time.monotonic()
        result["woke"] = C.wait(b, 8, 0, timeout=30)
        result["elapsed"] = time.monotonic() - t0
        result["value"] = C.load(b, 8)

    t = threading.Thread(target=waiter)
    t.start()
    try:
        # If wait() held the GIL, this thread could not run until it timed out.
        wake_until_blocked(b, 8, waiters=1)
        assert "woke" not in result  # a wake with the value unchanged is ignored
        C.store(b, 8, 5)
        C.wake(b, 8)
    finally:
        t.join(timeout=40)
    assert not t.is_alive()
    assert result == {"woke": True, "elapsed": result["elapsed"], "value": 5}
    assert result["elapsed"] < 25
    assert_released(b)


@pytest.mark.timeout(60)
def test_wake_counts_thread_waiters():
    b = bytearray(8)
    results = []
    threads = [threading.Thread(target=lambda: results.append(C.wait(b, 0, 0, timeout=30))) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        wake_until_blocked(b, 0, waiters=1, n=1)  # n=1 wakes at most one
        wake_until_blocked(b, 0, waiters=3)  # None wakes all of them
        assert results == []
        C.store(b, 0, 1)
        C.wake(b, 0)
    finally:
        for t in threads:
            t.join(timeout=40)
    assert results == [True, True, True]
    assert_released(b)


class _Interrupted(Exception):
    pass


@contextlib.contextmanager
def _sigusr1_to_main_thread(handler, interval: float, count: int | None):
    """Install handler for SIGUSR1 and deliver it to the main thread from a helper thread."""
    assert threading.current_thread() is threading.main_thread()
    target = threading.main_thread().ident
    stop = threading.Event()
    old = signal.signal(signal.SIGUSR1, handler)

    def pump():
        sent = 0
        while not stop.wait(interval) and (count is None or sent < count):
            signal.pthread_kill(target, signal.SIGUSR1)
            sent += 1

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=10)
        signal.signal(signal.SIGUSR1, old)


@pytest.mark.timeout(60)
def test_wait_propagates_exception_from_signal_handler():
    b = bytearray(8)

    def handler(signum, frame):
        raise _Interrupted

    t0 = time.monotonic()
    with pytest.raises(_Interrupted):
        with _sigusr1_to_main_thread(handler, interval=0.2, count=1):
            C.wait(b, 0, 0, timeout=30)
    assert time.monotonic() - t0 < 10
    assert_released(b)


@pytest.mark.timeout(60)
def test_wait_survives_signals_and_keeps_remaining_timeout():
    b = bytearray(8)
    calls = []
    timeout = 1.0
    with _sigusr1_to_main_thread(lambda s, f: calls.append(s), interval=0.05, count=None):
        t0 = time.monotonic()
        woke = C.wait(b, 0, 0, timeout=timeout)
        elapsed = time.monotonic() - t0
    assert woke is False
    assert len(calls) >= 3  # the handlers did run during the wait
    # Interrupted waits resume with the remaining time; restarting the full
    # timeout after every signal would never finish.
    assert timeout - 0.02 <= elapsed < 10
    assert_released(b)


# --------------------------------------------------------------------------- #
# Errors                                                                       #
# --------------------------------------------------------------------------- #

OPS = {
    "load": lambda b, off: C.load(b, off),
    "store": lambda b, off: C.store(b, off, 1),
    "compare_exchange": lambda b, off: C.compare_exchange(b, off, 0, 1),
    "fetch_add": lambda b, off: C.fetch_add(b, off, 1),
    "wait": lambda b, off: C.wait(b, off, 12345, timeout=0),
    "wake": lambda b, off: C.wake(b, off),
}


@pytest.fixture(params=sorted(OPS))
def op(request):
    return OPS[request.param]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("offset", [1, 3, 4, 7, 12])
def test_misaligned_offset(op, offset):
    b = bytearray(64)
    with pytest.raises(ValueError, match=f"offset {offset} is not 8-byte aligned"):
        op(b, offset)
    assert b == bytearray(64)
    assert_released(b)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size,offset", [(64, 64), (64, 72), (64, 2**40), (20, 16), (7, 0), (0, 0)])
def test_offset_out_of_range(op, size, offset):
    b = bytearray(size)
    with pytest.raises(IndexError, match="out of range"):
        op(b, offset)
    assert b == bytearray(size)
    assert_released(b)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("offset", [-8, -1, -(2**40)])
def test_negative_offset(op, offset):
    b = bytearray(64)
    with pytest.raises(IndexError, match="negative"):
        op(b, offset)
    assert_released(b)


@pytest.mark.timeout(60)
def test_huge_offset(op):
    b = bytearray(64)
    with pytest.raises(IndexError):
        op(b, 2**80)
    assert_released(b)


@pytest.mark.timeout(60)
def test_read_only_bytes(op):
    with pytest.raises(TypeError, match="writable"):
        op(b"\0" * 64, 0)


@pytest.mark.timeout(60)
def test_read_only_memoryview(op):
    backing = bytearray(64)
    with memoryview(backing).toreadonly() as ro:
        with pytest.raises(TypeError, match="writable"):
            op(ro, 0)
    assert_released(backing)


@pytest.mark.timeout(60)
def test_read_only_mmap(op):
    mm = mmap.mmap(-1, 4096, prot=mmap.PROT_READ)
    try:
        with pytest.raises(TypeError, match="writable"):
            op(mm, 0)
    finally:
        mm.close()  # BufferError here would mean a leaked export


@pytest.mark.timeout(60)
def test_unaligned_base_address(op):
    backing = bytearray(64)
    with memoryview(backing) as mv:
        start = (1 - _address(mv)) % 8  # the slice starts at an address 1 mod 8
        with mv[start : start + 32] as shifted:
            assert _address(shifted) % 8 == 1
            with pytest.raises(ValueError, match="base address .* not 8-byte aligned"):
                op(shifted, 0)
            with pytest.raises(ValueError, match="base address"):
                op(shifted, 8)
    assert_released(backing)


def _address(mv) -> int:
    """The address of the first byte of a writable buffer."""
    import ctypes

    view = ctypes.c_char.from_buffer(mv)
    try:
        return ctypes.addressof(view)
    finally:
        del view


@pytest.mark.timeout(60)
def test_not_a_buffer(op):
    with pytest.raises(TypeError):
        op(12345, 0)
    with pytest.raises(TypeError):
        op("a string, not a buffer", 0)


@pytest.mark.timeout(60)
def test_non_contiguous_array(op):
    if np is None:
        pytest.skip("numpy not installed")
    arr = np.zeros((4, 4), dtype=np.int64)
    with pytest.raises(TypeError, match="contiguous"):
        op(arr[:, 0], 0)


@pytest.mark.timeout(60)
def test_offset_must_be_integer(op):
    b = bytearray(64)
    with pytest.raises(TypeError, match="offset"):
        op(b, 8.0)
    assert_released(b)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 2**64])
def test_value_out_of_int64_range(value):
    b = bytearray(16)
    with pytest.raises(OverflowError):
        C.store(b, 0, value)
    with pytest.raises(OverflowError):
        C.fetch_add(b, 0, value)
    with pytest.raises(OverflowError):
        C.compare_exchange(b, 0, value, 0)
    with pytest.raises(OverflowError):
        C.compare_exchange(b, 0, 0, value)
    with pytest.raises(OverflowError):
        C.wait(b, 0, value, timeout=0)
    assert b == bytearray(16)
    assert_released(b)


@pytest.mark.timeout(60)
def test_value_must_be_integer():
    b = bytearray(16)
    with pytest.raises(TypeError):
        C.store(b, 0, 1.5)
    with pytest.raises(TypeError):
        C.fetch_add(b, 0, "1")
    with pytest.raises(TypeError):
        C.compare_exchange(b, 0, None, 1)
    assert_released(b)


@pytest.mark.timeout(60)
def test_bad_wait_timeout_and_wake_count():
    b = bytearray(16)
    with pytest.raises(ValueError, match="non-negative"):
        C.wait(b, 0, 0, timeout=-1)
    with pytest.raises(ValueError, match="NaN"):
        C.wait(b, 0, 0, timeout=float("nan"))
    with pytest.raises(TypeError, match="timeout"):
        C.wait(b, 0, 0, timeout="1")
    with pytest.raises(ValueError, match="non-negative"):
        C.wake(b, 0, -1)
    with pytest.raises(TypeError):
        C.wake(b, 0, 1.0)
    assert_released(b)


@pytest.mark.timeout(60)
def test_argument_counts():
    b = bytearray(16)
    with pytest.raises(TypeError):
        C.load(b)
    with pytest.raises(TypeError):
        C.load(b, 0, 0)
    with pytest.raises(TypeError):
        C.store(b, 0)
    with pytest.raises(TypeError):
        C.compare_exchange(b, 0, 1)
    with pytest.raises(TypeError):
        C.fetch_add(b, 0)
    with pytest.raises(TypeError):
        C.wait(b, 0)
    with pytest.raises(TypeError):
        C.wake(b)
    assert_released(b)


@pytest.mark.timeout(60)
def test_docstrings():
    assert C.__doc__ and "atomic" in C.__doc__.lower()
    for name in ("load", "store", "compare_exchange", "fetch_add", "wait", "wake"):
        fn = getattr(C, name)
        assert fn.__doc__ and len(fn.__doc__) > 40, name
        assert fn.__text_signature__ is not None, name


# --------------------------------------------------------------------------- #
# Cross-process                                                                #
# --------------------------------------------------------------------------- #


def _run_contended(worker, nprocs: int) -> tuple[int, list[int], list[int]]:
    """Run nprocs workers at once; return (final value, increments done, contention seen)."""
    with shared_segment() as shm:
        mv = shm.buf
        try:
            with child_processes() as procs:
                for i in range(nprocs):
                    start(procs, worker, shm.name, i)
                # Open the gate only once every child is ready, so they run
                # their loops at the same time.
                wait_for_value(mv, READY, nprocs)
                C.store(mv, GO, 1)
                C.wake(mv, GO)
                join_all(procs)
            done = [C.load(mv, RESULT + 8 * i) for i in range(nprocs)]
            assert all(d >= MIN_ITERATIONS for d in done), done
            return C.load(mv, VALUE), done, [C.load(mv, SEEN + 8 * i) for i in range(nprocs)]
        finally:
            mv.release()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nprocs", [2, 4])
def test_fetch_add_across_processes_is_exact(nprocs):
    total, done, contention = _run_contended(_fetch_add_worker, nprocs)
    print(f"increments per process {done}, gaps seen {contention}")
    assert total == sum(done), f"lost {sum(done) - total} of {sum(done)} increments"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nprocs", [2, 4])
def test_cas_loop_across_processes_is_exact(nprocs):
    total, done, retries = _run_contended(_cas_worker, nprocs)
    print(f"increments per process {done}, CAS retries {retries}")
    assert total == sum(done), f"lost {sum(done) - total} of {sum(done)} increments"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "new_value",
    [42, 7 + 2**32, -1, INT64_MIN],
    ids=["plain", "high-half-only", "minus-one", "int64-min"],
)
def test_cross_process_handoff(new_value):
    """Child waits on a word; the parent stores and wakes; the child sees the value."""
    with shared_segment() as shm:
        mv = shm.buf
        try:
            C.store(mv, VALUE, 7)
            with child_processes() as procs:
                child = start(procs, _waiter, shm.name, 7, 0)
                wait_for_value(mv, READY, 1)
                # The child is asleep in the kernel once a wake() reaches it;
                # those wakes leave the value at 7, so it must keep waiting.
                wake_until_blocked(mv, VALUE, waiters=1)
                time.sleep(0.1)
                assert C.load(mv, RESULT) == 0, "waiter returned although the value did not change"
                assert child.is_alive()
                C.store(mv, VALUE, new_value)
                C.wake(mv, VALUE)
                join_all(procs)
            assert C.load(mv, RESULT) == 1
            assert C.load(mv, SEEN) == new_value
        finally:
            mv.release()


@pytest.mark.timeout(60)
def test_cross_process_wake_all():
    nprocs = 3
    with shared_segment() as shm:
        mv = shm.buf
        try:
            with child_processes() as procs:
                for i in range(nprocs):
                    start(procs, _waiter, shm.name, 0, i)
                wait_for_value(mv, READY, nprocs)
                wake_until_blocked(mv, VALUE, waiters=1, n=1)
                wake_until_blocked(mv, VALUE, waiters=nprocs)  # all asleep at once
                assert [C.load(mv, RESULT + 8 * i) for i in range(nprocs)] == [0] * nprocs
                C.store(mv, VALUE, 1234)
                woken = C.wake(mv, VALUE)
                assert 0 <= woken <= nprocs
                join_all(procs)
            assert [C.load(mv, RESULT + 8 * i) for i in range(nprocs)] == [1] * nprocs
            assert [C.load(mv, SEEN + 8 * i) for i in range(nprocs)] == [1234] * nprocs
        finally:
            mv.release()


@pytest.mark.timeout(60)
def test_cross_process_wait_times_out():
    """A child waiting on a shared word that nobody changes times out with False."""
    timeout = 0.5
    with shared_segment() as shm:
        mv = shm.buf
        try:
            C.store(mv, VALUE, 5)
            with child_processes() as procs:
                start(procs, _waiter, shm.name, 5, 0, timeout)
                join_all(procs)
            assert C.load(mv, RESULT) == 2  # timed out
            assert C.load(mv, SEEN) == 5
            elapsed = C.load(mv, ELAPSED) / 1e9
            assert timeout - 0.02 <= elapsed < 10
        finally:
            mv.release()


@pytest.mark.timeout(60)
def test_ctrl_c_interrupts_wait_in_child():
    with shared_segment() as shm:
        mv = shm.buf
        try:
            with child_processes() as procs:
                child = start(procs, _interruptible_waiter, shm.name)
                wait_for_value(mv, READY, 1)
                wake_until_blocked(mv, VALUE, waiters=1)  # asleep, with no timeout
                # Let it settle back into the kernel after the probing wakes.  A
                # signal that lands in the few instructions between wait()'s
                # signal check and its futex call is only seen on the next
                # wakeup (as with any blocking call), so resend if needed.
                time.sleep(0.2)
                deadline = time.monotonic() + CHILD_TIMEOUT
                while C.load(mv, RESULT) == 0 and child.is_alive():
                    assert time.monotonic() < deadline, "SIGINT never interrupted wait()"
                    os.kill(child.pid, signal.SIGINT)
                    C.wait(mv, RESULT, 0, timeout=3)
                join_all(procs)
            assert C.load(mv, RESULT) == 3  # KeyboardInterrupt raised inside wait()
        finally:
            mv.release()

