"""What the IO thread and the busy loop hand each other: typed items, and the bounded
per-client inboxes the busy loop reads round robin.

IO thread → busy loop, per client, in the order the client's frames came (so a
client's Hello is seen before its Submits, and its Submit before its Cancel):
`ClientConnected`, `FromClient`, `ClientGone`. Anything else — a wake-up from the
decode stage or a signal handler, a drain, a fatal error of the IO thread — goes on
the control queue (`queue.SimpleQueue`, whose put() a signal handler may call).

Busy loop → IO thread, one queue: `Send`, `Broadcast`, `StopIO`.

Bounds: an inbox only grows while its client sends faster than the busy loop reads;
the IO thread checks `pending(identity)` before it forwards and refuses the excess
(engine.serve.io_thread), and the busy loop takes at most a fixed number of items per
iteration, one client at a time in turn, so one client's flood neither grows the engine
nor delays the other clients' messages behind it.
"""
from __future__ import annotations

import collections
import dataclasses
import queue
import threading

from engine.protocol import Cancel, Delivered, Hello, Stats, Submit


# --------------------------------------------------------------------- IO thread → busy loop

@dataclasses.dataclass(frozen=True, slots=True)
class ClientConnected:
    identity: bytes
    hello: Hello


@dataclasses.dataclass(frozen=True, slots=True)
class FromClient:
    identity: bytes
    message: Submit | Cancel | Delivered | Stats
    arrival: float  # time.monotonic() when the IO thread received it
    input_bytes: int = 0  # what a Submit's image inputs hold in `InputQueues.input_bytes` until its request ends


@dataclasses.dataclass(frozen=True, slots=True)
class ClientGone:
    identity: bytes
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class Wake:
    """Look at the inboxes and the decode stage now."""


@dataclasses.dataclass(frozen=True, slots=True)
class Drain:
    reason: str  # SIGTERM: finish what is in flight, accept nothing new


@dataclasses.dataclass(frozen=True, slots=True)
class Shutdown:
    reason: str  # stop at once (the IO thread crashed)


WAKE = Wake()
ClientItem = ClientConnected | FromClient | ClientGone
ControlItem = Wake | Drain | Shutdown


# --------------------------------------------------------------------- busy loop → IO thread

@dataclasses.dataclass(frozen=True, slots=True)
class Send:
    identity: bytes
    message: object
    payload: object = None  # bytes or a numpy array: one extra zero-copy frame


@dataclasses.dataclass(frozen=True, slots=True)
class Broadcast:
    message: object  # to every connected client


@dataclasses.dataclass(frozen=True, slots=True)
class StopIO:
    """Send what is queued, then close the socket."""


OutputItem = Send | Broadcast | StopIO


# --------------------------------------------------------------------- image input bytes

class InputBytes:
    """Image input bytes held for each client, from the IO thread's receipt of a Submit
    until its request ends (or is refused): the IO thread holds, the busy loop releases.
    A client may hold `per_client`, all clients together `total`; past either a Submit is
    refused, except that a client holding nothing (and, for the total, an engine holding
    nothing) is always let one request in, so every valid request is served one at a time
    at worst."""

    def __init__(self, per_client: int, total: int) -> None:
        self.per_client, self.total = per_client, total
        self._lock = threading.Lock()
        self._held: dict[bytes, int] = {}
        self.held_total = 0  # read for stats (an int load is atomic)

    def hold(self, identity: bytes, nbytes: int) -> str | None:
        """Hold `nbytes` for the client; or why not (nothing is held then)."""
        with self._lock:
            mine = self._held.get(identity, 0)
            if mine and mine + nbytes > self.per_client:
                return (f"this client's requests hold {mine} bytes of image inputs; {nbytes} more would pass its "
                        f"limit of {self.per_client} (--max-input-bytes-per-client)")
            if self.held_total and self.held_total + nbytes > self.total:
                return (f"the engine holds {self.held_total} bytes of image inputs; {nbytes} more would pass its "
                        f"limit of {self.total} (--max-input-bytes-total)")
            self._held[identity] = mine + nbytes
            self.held_total += nbytes
        return None

    def release(self, identity: bytes, nbytes: int) -> None:
        if nbytes <= 0:
            return
        with self._lock:
            left = self._held.get(identity, 0) - nbytes
            if left > 0:
                self._held[identity] = left
            else:
                self._held.pop(identity, None)
            self.held_total -= nbytes

    def held(self, identity: bytes) -> int:
        return self._held.get(identity, 0)


# --------------------------------------------------------------------- the inboxes

class InputQueues:
    """The control queue and one inbox per client. The IO thread puts, the busy loop takes."""

    def __init__(self, input_bytes: InputBytes | None = None) -> None:
        self.control: queue.SimpleQueue = queue.SimpleQueue()
        self.input_bytes = input_bytes or InputBytes(1 << 62, 1 << 62)
        self._lock = threading.Lock()
        self._inboxes: dict[bytes, collections.deque] = {}
        self._ready: collections.deque[bytes] = collections.deque()  # clients with items, in turn order

    # -------------------------------------------------- IO thread
    def pending(self, identity: bytes) -> int:
        inbox = self._inboxes.get(identity)
        return 0 if inbox is None else len(inbox)

    def put(self, item: ClientItem) -> None:
        with self._lock:
            inbox = self._inboxes.get(item.identity)
            if inbox is None:
                inbox = self._inboxes[item.identity] = collections.deque()
            first = not inbox
            inbox.append(item)
            if first:
                self._ready.append(item.identity)
        if first:  # the busy loop may be asleep on the control queue
            self.control.put(WAKE)

    def put_gone(self, gone: ClientGone) -> None:
        """The client is written off: what it sent and the busy loop has not read yet is
        dropped (its requests are canceled anyway); `gone` is the last item of its inbox."""
        with self._lock:
            inbox = self._inboxes.get(gone.identity)
            if inbox is None:
                inbox = self._inboxes[gone.identity] = collections.deque()
            if not inbox:
                self._ready.append(gone.identity)
            for item in inbox:  # never taken: their image inputs are let go here
                if isinstance(item, FromClient):
                    self.input_bytes.release(item.identity, item.input_bytes)
            inbox.clear()
            inbox.append(gone)
        self.control.put(WAKE)

    # -------------------------------------------------- busy loop
    def has_client_items(self) -> bool:
        return bool(self._ready)

    def waiting(self) -> int:
        """Client items not taken yet, all clients together."""
        with self._lock:
            return sum(len(inbox) for inbox in self._inboxes.values())

    def take(self, limit: int, per_client: int) -> list[ClientItem]:
        """Up to `limit` items, at most `per_client` of any one client, taken one per client
        in turn; each client's items in their order."""
        items = []
        taken: dict[bytes, int] = {}
        with self._lock:
            skipped = []  # clients that had their share this time: first in turn next time
            while self._ready and len(items) < limit:
                identity = self._ready.popleft()
                if taken.get(identity, 0) >= per_client:
                    skipped.append(identity)
                    continue
                inbox = self._inboxes[identity]
                item = inbox.popleft()
                items.append(item)
                taken[identity] = taken.get(identity, 0) + 1
                if isinstance(item, ClientGone):
                    del self._inboxes[identity]  # nothing follows a ClientGone
                elif inbox:
                    self._ready.append(identity)
            self._ready.extendleft(reversed(skipped))
        return items
