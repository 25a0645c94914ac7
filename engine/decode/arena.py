"""The decode arena: one shared-memory segment of decode buffers, allocated
once at engine start and shared with the decode worker processes.

Layout (all offsets page-aligned; every header field is one native int64 word):

    page 0      global header: magic, geometry, doorbells, stale counter, worker table
    headers     one 256-byte header per buffer (HEADER_WORDS words)
    buffer i    latent area (float32, sized for the largest latent)
                output area (sized for the largest output: H×W×3 uint8 plus PNG slack,
                or the latents themselves)

The hand-off is lock-free: every buffer's STATE word is changed only with `engine._C`
atomics (compare_exchange / store), and the two doorbells (SUBMIT_SEQ: engine → workers,
DONE_SEQ: workers → engine) are counters that sleepers futex-wait on. No pipe, no
pickling, no lock: the engine writes the latents and the header words, then publishes
the STATE word (release); a worker claims it by compare-and-swap (acquire), and the
reverse for the output.

STATE word = epoch << 24 | worker id << 8 | state. The epoch increments on every
publish (and on a revoke), so a compare-and-swap that expects (epoch, state) cannot
succeed on a buffer that was meanwhile reused: a stale hand-off fails its CAS, is
dropped, and counted (G_STALE).

    FREE(e) ──engine publish──▶ READY(e+1) ──worker CAS──▶ CLAIMED(e+1, w)
    READY(e) ──engine cancel CAS──▶ FREE(e)                       (never claimed)
    CLAIMED(e, w) ──worker CAS──▶ DONE(e, w) | FAILED(e, w)       (output / reason written first)
    CLAIMED(e, w) ──engine revoke CAS (deadline)──▶ REVOKED(e+1, w)  (the worker's CAS now fails)
    DONE | FAILED ──engine, after copying the output out──▶ FREE
    CLAIMED | REVOKED by a worker that is dead (reaped) ──engine──▶ FREE

Only the engine writes a FREE buffer; only the claiming worker writes a CLAIMED one's
latent-independent fields (claim time, pid, deadline, output); the engine takes a
CLAIMED buffer back only after that worker is dead.

Segment names start with `diffslot-<engine pid>-`; `sweep_stale()` removes those
whose engine is gone. When CUDA is used the whole segment is page-locked with
`cudaHostRegister`, so the final latents' device-to-host copy runs asynchronously into it.
"""
from __future__ import annotations

import logging
import mmap
import os
import pathlib
import re
import time
from multiprocessing.shared_memory import SharedMemory

import numpy as np

from engine import _C
from engine.processes import pid_alive
from engine.protocol import OUTPUT_KINDS, SEGMENT_PREFIX

log = logging.getLogger("diffslot.arena")

SHM_DIR = pathlib.Path("/dev/shm")
PREFIX = SEGMENT_PREFIX
_NAME = re.compile(r"^diffslot-(\d+)-")
PAGE = 4096
WORD = 8
MAGIC = 0x64736C6F74617231  # "dslotar1"
MAX_WORKERS = 64

# ---- global header words (byte offset = index * 8) -----------------------------------
G_MAGIC = 0
G_BUFFERS = 1
G_LATENT_BYTES = 2
G_OUTPUT_BYTES = 3
G_OWNER_PID = 4
G_SUBMIT_SEQ = 8  # doorbell: engine → workers (a counter; workers futex-wait on it)
G_DONE_SEQ = 9  # doorbell: workers → engine
G_STOP = 10  # 1: workers exit
G_STALE = 11  # stale hand-offs dropped by workers
G_WORKERS = 16  # G_WORKERS + k: pid of worker k once its model is loaded (0: not ready)

# ---- per-buffer header words -------------------------------------------------------------
HEADER_WORDS = 32
HEADER_BYTES = HEADER_WORDS * WORD
H_STATE = 0  # epoch << 24 | worker id << 8 | state
H_CANCEL = 1  # the epoch whose decode is canceled (0: none)
H_REQ_HASH = 2  # 63-bit hash of the request id (the id itself stays in the engine's side table)
H_KIND = 3  # output kind code
H_NDIM = 4  # latent ndim (≤ 4) and dims in H_DIMS..
H_DIMS = 5
H_SUBMIT_NS = 9  # time.monotonic_ns() at publish (engine)
H_CLAIM_NS = 10  # at claim (worker): the decode starts
H_DEADLINE_NS = 11  # claim + decode timeout (worker); 0: none
H_DONE_NS = 12  # at DONE / FAILED (worker)
H_WORKER_PID = 13  # pid of the claiming worker
H_DELAY_US = 14  # test hook: the worker sleeps this long before decoding
H_OUT_LEN = 15  # bytes of output (or of the error message) in the output area
H_OUT_NDIM = 16
H_OUT_DIMS = 17
H_OUT_DTYPE = 21
H_FAIL = 22  # FAIL_* reason of a FAILED buffer
H_TIMEOUT_NS = 23  # decode timeout chosen by the engine; 0: none

# states
FREE, READY, CLAIMED, DONE, FAILED, REVOKED = range(6)
STATE_NAMES = ("FREE", "READY", "CLAIMED", "DONE", "FAILED", "REVOKED")
# FAILED reasons
FAIL_CANCELED, FAIL_ERROR = 1, 2
# output kinds / dtypes
KINDS = OUTPUT_KINDS
DTYPES = ("", "uint8", "float32")

_EPOCH_LIMIT = 1 << 39


def pack(state: int, worker: int, epoch: int) -> int:
    return (epoch % _EPOCH_LIMIT) << 24 | worker << 8 | state


def unpack(word: int) -> tuple[int, int, int]:
    """(state, worker id, epoch) of a STATE word."""
    return word & 0xFF, (word >> 8) & 0xFFFF, word >> 24


def _align(n: int, to: int = PAGE) -> int:
    return (n + to - 1) // to * to


def segment_name(pid: int | None = None, suffix: str = "arena") -> str:
    return f"{PREFIX}{os.getpid() if pid is None else pid}-{suffix}"


def request_hash(request_id: str) -> int:
    import hashlib

    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little") >> 1


# ---- stale segments ----------------------------------------------------------------------

def _boot_time() -> float | None:
    try:
        for line in pathlib.Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except OSError:
        pass
    return None


def _process_start(pid: int) -> float | None:
    """Wall-clock start time of a live process (None if unknown)."""
    try:
        text = pathlib.Path(f"/proc/{pid}/stat").read_text()
        ticks = int(text[text.rindex(")") + 2:].split()[19])
        boot = _boot_time()
        return None if boot is None else boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def sweep_stale(directory: pathlib.Path | str = SHM_DIR) -> list[str]:
    """Remove `diffslot-<pid>-*` segments whose engine is gone: the pid is not alive, or
    it was reused by a process started after the segment was made. Returns the names
    removed. Segments of live engines (and names without a pid) are left alone."""
    directory = pathlib.Path(directory)
    removed = []
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return removed
    me = os.getpid()
    for path in entries:
        match = _NAME.match(path.name)
        if match is None:
            continue
        pid = int(match.group(1))
        if pid == me:
            continue
        stale = not pid_alive(pid)
        if not stale:
            started = _process_start(pid)
            try:
                made = path.stat().st_mtime
            except FileNotFoundError:
                continue
            stale = started is not None and started > made + 2.0  # pid reused since
        if stale:
            try:
                path.unlink()
                removed.append(path.name)
                log.info("removed stale shared memory segment %s (engine pid %d is gone)", path.name, pid)
            except FileNotFoundError:
                pass
            except PermissionError:
                log.warning("cannot remove stale segment %s: permission denied", path.name)
    return removed


# ---- the arena --------------------------------------------------------------------------------

class Arena:
    """A view of the arena segment. `Arena.create` (engine) owns and unlinks it;
    `Arena.attach` (workers) maps it by name."""

    def __init__(self, name: str, buf, buffers: int, latent_bytes: int, output_bytes: int,
                 shm: SharedMemory | None = None, mapping: mmap.mmap | None = None):
        self.name = name
        self.buf = buf  # exports a writable buffer: what the _C atomics take
        self.buffers = buffers
        self.latent_bytes = latent_bytes
        self.output_bytes = output_bytes
        self._shm = shm
        self._mmap = mapping
        self._headers = PAGE
        self._data = _align(PAGE + buffers * HEADER_BYTES)
        self._latent_stride = _align(latent_bytes)
        self._stride = self._latent_stride + _align(output_bytes)
        self.size = self._data + buffers * self._stride
        self._bytes = np.frombuffer(buf, dtype=np.uint8, count=self.size)  # every data view derives from it
        self._pinned: int | None = None
        self._pending: list = []  # CUDA events of async copies into / out of the segment (close waits)
        self.closed = False

    # ---- construction -------------------------------------------------------------------
    @staticmethod
    def nbytes(buffers: int, latent_bytes: int, output_bytes: int) -> int:
        return _align(PAGE + buffers * HEADER_BYTES) + buffers * (_align(latent_bytes) + _align(output_bytes))

    @classmethod
    def create(cls, buffers: int, latent_bytes: int, output_bytes: int, name: str | None = None) -> "Arena":
        if not 1 <= buffers <= 4096:
            raise ValueError("buffers must be in [1, 4096]")
        size = cls.nbytes(buffers, latent_bytes, output_bytes)
        candidates = [name] if name else [segment_name()] + [segment_name(suffix=f"arena-{k}") for k in range(2, 64)]
        shm = None
        for candidate in candidates:
            try:
                shm = SharedMemory(name=candidate, create=True, size=size)
                break
            except FileExistsError:  # a second arena in this process (tests): next name
                if name:
                    raise
        if shm is None:
            raise FileExistsError("no free arena name")
        try:
            try:  # reserve the pages now: a full /dev/shm fails here, not with SIGBUS mid-decode
                os.posix_fallocate(shm._fd, 0, size)
            except (AttributeError, OSError) as exc:
                if isinstance(exc, OSError) and exc.errno == 28:
                    raise OSError(28, f"/dev/shm has no room for a {size}-byte decode arena") from None
            arena = cls(shm.name.lstrip("/"), shm.buf, buffers, latent_bytes, output_bytes, shm=shm)
        except BaseException:
            shm.close()
            shm.unlink()
            raise
        arena.store_global(G_BUFFERS, buffers)
        arena.store_global(G_LATENT_BYTES, latent_bytes)
        arena.store_global(G_OUTPUT_BYTES, output_bytes)
        arena.store_global(G_OWNER_PID, os.getpid())
        arena.store_global(G_MAGIC, MAGIC)
        return arena

    @property
    def fd(self) -> int | None:
        """The creator's open descriptor of the segment (None in a worker)."""
        return getattr(self._shm, "_fd", None)

    @classmethod
    def attach(cls, name: str, owner_pid: int | None = None, owner_fd: int | None = None) -> "Arena":
        """Map an existing arena (a worker process). Plain mmap of /dev/shm/<name>: no
        resource-tracker registration, so only the engine ever unlinks the segment. If
        the name was removed under a live engine, the engine's own descriptor
        (/proc/<owner_pid>/fd/<owner_fd>) still reaches the segment."""
        try:
            fd = os.open(SHM_DIR / name, os.O_RDWR)
        except FileNotFoundError:
            if owner_pid is None or owner_fd is None:
                raise
            fd = os.open(f"/proc/{owner_pid}/fd/{owner_fd}", os.O_RDWR)
        try:
            mapping = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        head = np.frombuffer(mapping, dtype=np.int64, count=PAGE // WORD)
        if int(head[G_MAGIC]) != MAGIC:
            raise ValueError(f"{name} is not a diffslot decode arena")
        buffers, latent_bytes, output_bytes = (int(head[k]) for k in (G_BUFFERS, G_LATENT_BYTES, G_OUTPUT_BYTES))
        del head
        return cls(name, mapping, buffers, latent_bytes, output_bytes, mapping=mapping)

    # ---- CUDA page-locking ------------------------------------------------------------------
    def pin(self) -> bool:
        """Page-lock the whole segment for CUDA (cudaHostRegister); False if CUDA is not used."""
        try:
            import torch

            if not torch.cuda.is_available() or self._pinned is not None:
                return self._pinned is not None
            ptr = self._bytes.ctypes.data
            err = int(torch.cuda.cudart().cudaHostRegister(ptr, self.size, 1))  # cudaHostRegisterPortable
            if err != 0:
                log.warning("cudaHostRegister of the decode arena failed (error %d); copies stay synchronous", err)
                return False
            self._pinned = ptr
            return True
        except Exception:
            log.warning("page-locking the decode arena failed", exc_info=True)
            return False

    def track_copy(self, event) -> None:
        """Note a CUDA event recorded after an async copy into (or out of) this segment:
        `close()` waits for it before unpinning and unmapping. Completed ones are dropped."""
        self._pending = [e for e in self._pending if not e.query()]
        self._pending.append(event)

    def wait_for_copies(self) -> None:
        """Block until no device copy can still touch the segment: every tracked event,
        then (pinned segments) every CUDA device, since a copy enqueued by code that did
        not track its event may still be in flight."""
        pending, self._pending = self._pending, []
        for event in pending:
            try:
                event.synchronize()
            except Exception:
                log.warning("waiting for a copy into the decode arena failed", exc_info=True)
        if self._pinned is None:
            return
        try:
            import torch

            for device in range(torch.cuda.device_count()):
                torch.cuda.synchronize(device)
        except Exception:  # a dead context copies nothing any more
            log.warning("synchronising CUDA before unpinning the decode arena failed", exc_info=True)

    def _unregister(self) -> None:
        if self._pinned is None:
            return
        try:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self._pinned)
        except Exception:
            log.warning("cudaHostUnregister of the decode arena failed", exc_info=True)
        self._pinned = None

    # ---- words -----------------------------------------------------------------------------
    def load_global(self, word: int) -> int:
        return _C.load(self.buf, word * WORD)

    def store_global(self, word: int, value: int) -> None:
        _C.store(self.buf, word * WORD, value)

    def _h(self, i: int, word: int) -> int:
        return self._headers + i * HEADER_BYTES + word * WORD

    def load(self, i: int, word: int) -> int:
        return _C.load(self.buf, self._h(i, word))

    def store(self, i: int, word: int, value: int) -> None:
        _C.store(self.buf, self._h(i, word), value)

    def state(self, i: int) -> tuple[int, int, int]:
        """(state, worker id, epoch) of buffer i."""
        return unpack(_C.load(self.buf, self._h(i, H_STATE)))

    def cas_state(self, i: int, expected: int, desired: int) -> tuple[bool, int]:
        return _C.compare_exchange(self.buf, self._h(i, H_STATE), expected, desired)

    # ---- data areas ------------------------------------------------------------------------
    def latent_array(self, i: int, shape: tuple[int, ...]) -> np.ndarray:
        count = int(np.prod(shape))
        if count * 4 > self.latent_bytes:
            raise ValueError(f"latents of shape {tuple(shape)} exceed the arena's {self.latent_bytes}-byte buffers")
        start = self._data + i * self._stride
        return self._bytes[start:start + count * 4].view(np.float32).reshape(shape)

    def output_area(self, i: int) -> np.ndarray:
        start = self._data + i * self._stride + self._latent_stride
        return self._bytes[start:start + self.output_bytes]

    # ---- engine side -----------------------------------------------------------------------
    def publish(self, i: int, *, kind: int, shape: tuple[int, ...], req_hash: int, delay_s: float = 0.0,
                timeout_s: float | None = None) -> int:
        """Hand buffer i (FREE; its latents already written) to the workers. Returns the epoch."""
        state, _, epoch = self.state(i)
        if state != FREE:
            raise RuntimeError(f"buffer {i} is {STATE_NAMES[state]}, not FREE")
        epoch = epoch % _EPOCH_LIMIT + 1
        self.store(i, H_CANCEL, 0)
        self.store(i, H_REQ_HASH, req_hash)
        self.store(i, H_KIND, kind)
        self.store(i, H_NDIM, len(shape))
        for k, d in enumerate(shape):
            self.store(i, H_DIMS + k, int(d))
        self.store(i, H_DELAY_US, int(delay_s * 1e6))
        self.store(i, H_TIMEOUT_NS, int(timeout_s * 1e9) if timeout_s else 0)
        for word in (H_CLAIM_NS, H_DEADLINE_NS, H_DONE_NS, H_WORKER_PID, H_OUT_LEN, H_FAIL):
            self.store(i, word, 0)
        self.store(i, H_SUBMIT_NS, time.monotonic_ns())
        self.store(i, H_STATE, pack(READY, 0, epoch))  # release: everything above is visible first
        self.ring(G_SUBMIT_SEQ, 1)
        return epoch

    def unpublish(self, i: int, epoch: int) -> bool:
        """Take back a READY buffer no worker has claimed (cancel before decode)."""
        ok, _ = self.cas_state(i, pack(READY, 0, epoch), pack(FREE, 0, epoch))
        return ok

    def revoke(self, i: int, epoch: int, worker: int) -> bool:
        """Take the hand-off away from a worker that overran its deadline: its own
        completion CAS then fails (a stale hand-off). The buffer stays out of use until
        that worker is known dead."""
        ok, _ = self.cas_state(i, pack(CLAIMED, worker, epoch), pack(REVOKED, worker, epoch + 1))
        return ok

    def free(self, i: int) -> None:
        _, _, epoch = self.state(i)
        self.store(i, H_STATE, pack(FREE, 0, epoch))

    def ring(self, word: int, n: int | None) -> None:
        """Bump a doorbell counter and wake up to n of its sleepers (None: all)."""
        _C.fetch_add(self.buf, word * WORD, 1)
        _C.wake(self.buf, word * WORD, n)

    def wait(self, word: int, seen: int, timeout: float | None) -> bool:
        return _C.wait(self.buf, word * WORD, seen, timeout)

    # ---- worker side -----------------------------------------------------------------------
    def claim(self, i: int, worker: int, word: int | None = None) -> int | None:
        """Claim buffer i if it is READY — if `word` is given, only if its STATE word is
        still exactly that (same epoch: a worker that read the header of an earlier
        hand-off cannot claim a later one). Returns the epoch, or None."""
        if word is None:
            word = self.load(i, H_STATE)
        state, _, epoch = unpack(word)
        if state != READY:
            return None
        ok, _ = self.cas_state(i, word, pack(CLAIMED, worker, epoch))
        return epoch if ok else None

    def finish(self, i: int, epoch: int, worker: int, state: int) -> bool:
        """CLAIMED → DONE / FAILED. False (and counted) if the hand-off went stale meanwhile."""
        ok, _ = self.cas_state(i, pack(CLAIMED, worker, epoch), pack(state, worker, epoch))
        if not ok:
            _C.fetch_add(self.buf, G_STALE * WORD, 1)
            return False
        self.ring(G_DONE_SEQ, 1)
        return True

    def cancel_requested(self, i: int, epoch: int) -> bool:
        if self.load(i, H_CANCEL) == epoch:
            return True
        state, _, now = self.state(i)
        return now != epoch or state != CLAIMED

    # ---- teardown --------------------------------------------------------------------------
    def close(self, unlink: bool | None = None) -> None:
        """Unmap (and, for the creator, unlink) the segment. Idempotent.

        Order: wait for every device copy that may still write into (or read from) the
        segment, then unpin, then unlink and unmap: an async device-to-host copy into an
        unmapped page would write into whatever is mapped there next."""
        if self.closed:
            return
        self.closed = True
        self.wait_for_copies()
        self._unregister()
        if unlink is None:
            unlink = self._shm is not None
        if unlink:
            try:
                if self._shm is not None:
                    self._shm.unlink()
                else:
                    os.unlink(SHM_DIR / self.name)
            except FileNotFoundError:  # someone removed the name already
                if self._shm is not None:
                    try:
                        from multiprocessing import resource_tracker

                        resource_tracker.unregister(self._shm._name, "shared_memory")
                    except Exception:
                        pass
        self._bytes = None
        self.buf = None
        try:
            if self._shm is not None:
                self._shm.close()
            elif self._mmap is not None:
                self._mmap.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with it
            log.debug("arena %s: a view outlives close(); unmapped at exit", self.name)
