"""Atomic operations and futex wait/wake on 64-bit words in shared memory.

Every function takes ``buf``, any object exporting a writable C-contiguous
buffer (``mmap.mmap``, ``SharedMemory.buf``, ``bytearray``, a numpy array, a
writable ``memoryview``), and ``offset``, the byte offset of a native-endian
signed 64-bit word in it.  The offset must be a non-negative multiple of 8 with
``offset + 8 <= len(buf)`` and the buffer's base address must be 8-byte aligned.

Errors: a misaligned offset or buffer address raises ``ValueError``; a negative
or out-of-range offset raises ``IndexError``; a read-only or non-contiguous
buffer raises ``TypeError``; a value outside int64 raises ``OverflowError``.

The operations are lock-free hardware atomics and work between processes that
map the same memory; ``wait``/``wake`` use shared (non-private) Linux futexes.
"""

from typing_extensions import Buffer
from typing import SupportsIndex

def load(buf: Buffer, offset: SupportsIndex, /) -> int:
    """Atomically read the word (acquire ordering) and return it."""

def store(buf: Buffer, offset: SupportsIndex, value: int, /) -> None:
    """Atomically write ``value`` (release ordering).

    Does not wake waiters; call :func:`wake` after storing.
    """

def compare_exchange(
    buf: Buffer, offset: SupportsIndex, expected: int, desired: int, /
) -> tuple[bool, int]:
    """Strong sequentially consistent compare-and-swap.

    Replaces the word with ``desired`` if it equals ``expected``.  Returns
    ``(success, observed)``, ``observed`` being the value held just before
    (equal to ``expected`` exactly when ``success``).
    """

def fetch_add(buf: Buffer, offset: SupportsIndex, delta: int, /) -> int:
    """Atomically add ``delta`` (sequentially consistent); return the old value.

    Overflow wraps around in two's complement: ``INT64_MAX + 1 == INT64_MIN``.
    """

def wait(
    buf: Buffer, offset: SupportsIndex, expected: int, /, timeout: float | None = None
) -> bool:
    """Block while the word equals ``expected``.

    Returns True as soon as the word is observed to differ (immediately if it
    already does), False once ``timeout`` seconds pass (None: wait forever).
    Sleeps on a shared futex on the low 32-bit half of the word and re-checks
    the full 64-bit value after every wakeup, so spurious wakeups and wakes that
    leave the value unchanged go back to sleep.  Writers must call :func:`wake`
    after changing the word.  A change confined to the high 32 bits that races
    with the waiter falling asleep can be missed until the next wake or the
    timeout, so waited-on values should differ in their low 32 bits (a counter
    stepped by anything but a multiple of 2**32 always does).  The GIL is released while sleeping; a signal
    handler that raises (Ctrl-C) interrupts the wait, otherwise it continues for
    the remaining time on the monotonic clock.
    """

def wake(buf: Buffer, offset: SupportsIndex, /, n: int | None = None) -> int:
    """Wake up to ``n`` waiters on the word (None: all); return how many woke."""
