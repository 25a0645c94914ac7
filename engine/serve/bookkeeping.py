"""The engine process's books: every accepted request, every client, and the output bytes
each client holds.

A client holds the worst-case bytes of the outputs its unfinished requests have yet to
produce (final outputs and partial images alike), plus the bytes it has been sent and
has not acknowledged with `Delivered` (a Completed, and the partial images sent before
a request's final message). A Submit is refused when those bytes would pass the
client's budget, or when the bytes held for all clients would pass
`max_backlog_bytes` and this client holds more than its fair share of them; a request
whose outputs could never fit the budget is refused without a retry. So a client that
stops reading holds at most its own budget, and the clients that read stay served.
A request id is the client's until its final message is out and, if it was sent bytes,
until their `Delivered`; reusing it earlier is refused naming `request_id`.
"""
from __future__ import annotations

import dataclasses

from engine.protocol import Timings
from engine.serve.options import ProcConfig


@dataclasses.dataclass
class HeldFinal:
    """A request's final message, waiting for its partial images to go out first."""

    message: object
    payload: object


@dataclasses.dataclass
class RequestRecord:
    rid: str  # the engine's request id: the client's tag and its own id
    identity: bytes
    client_request_id: str
    arrival: float
    want_progress: bool
    reserved_bytes: int  # worst case of the outputs not produced yet (final and partial images)
    preview_bytes: int = 0  # worst case of one partial image
    started: bool = False  # a denoising step has run
    cancel_requested: bool = False
    in_decode: bool = False  # the decode stage holds its final output: keep the record until it comes back
    terminal: bool = False  # its final message is out (or its client is gone)
    timings: Timings | None = None
    decode_key: str | None = None  # its final output's key in the decode stage
    preview_keys: set[str] = dataclasses.field(default_factory=set)  # its partial images in the decode stage
    held_final: HeldFinal | None = None
    input_bytes: int = 0  # its image inputs' hold on its client's input bytes (engine.serve.handoff.InputBytes)


@dataclasses.dataclass
class ClientRecord:
    identity: bytes
    tag: str  # namespaces request ids in the core, so clients cannot clash or cancel each other's
    requests: set[str] = dataclasses.field(default_factory=set)  # engine request ids
    reserved_bytes: int = 0
    unacknowledged: dict[str, int] = dataclasses.field(default_factory=dict)  # client request id → bytes sent
    unacknowledged_bytes: int = 0

    @property
    def held_bytes(self) -> int:
        return self.reserved_bytes + self.unacknowledged_bytes


@dataclasses.dataclass(frozen=True)
class Refusal:
    reason: str
    field: str | None = None
    retry_after_s: float = 0.0
    counter: str | None = None  # the fault_stats counter it adds to


class RequestBook:
    def __init__(self, config: ProcConfig, input_bytes=None) -> None:
        self.config = config
        self.input_bytes = input_bytes  # engine.serve.handoff.InputBytes: released when a request ends
        self.requests: dict[str, RequestRecord] = {}
        self.clients: dict[bytes, ClientRecord] = {}

    # ------------------------------------------------------------------ clients
    def connect(self, identity: bytes) -> ClientRecord:
        client = self.clients[identity] = ClientRecord(identity, identity.hex())
        return client

    def disconnect(self, identity: bytes) -> ClientRecord | None:
        return self.clients.pop(identity, None)

    def rid(self, client: ClientRecord, client_request_id: str) -> str:
        return f"{client.tag}:{client_request_id}"

    # ------------------------------------------------------------------ admission
    def refusal(self, client: ClientRecord, client_request_id: str, output_bytes: int, preview_bytes: int,
                previews: int) -> Refusal | None:
        """Why a Submit may not be taken now, or None."""
        if self.rid(client, client_request_id) in self.requests:
            return Refusal("request_id is already in use by an unfinished request", "request_id")
        if client_request_id in client.unacknowledged:
            return Refusal("request_id is still in use: the engine sent its outputs and awaits their Delivered",
                           "request_id")
        limit = self.config.max_queue_per_client
        if limit:
            waiting = sum(1 for rid in client.requests if not self.requests[rid].started
                          and not self.requests[rid].terminal)
            if waiting >= limit:
                return Refusal(f"this client already has {waiting} requests waiting for a slot: its share of the "
                               f"queue is {limit} (--max-queue-per-client)", None, 0.5, "rejected_client_queue_share")
        reserve = output_bytes + previews * preview_bytes
        budget = self.config.output_budget_bytes
        if reserve > budget:
            field = "partial_images" if output_bytes <= budget else "height"
            return Refusal(f"this request's outputs need {reserve} bytes ({previews} partial images included), more "
                           f"than a client's output budget of {budget} bytes", field)
        if client.held_bytes + reserve > budget:
            return Refusal(f"client output budget exhausted: {client.held_bytes} of {budget} bytes undelivered or "
                           f"reserved (read results and acknowledge them)", None, 1.0)
        cap = self.config.max_backlog_bytes
        if cap:
            held = sum(c.held_bytes for c in self.clients.values())
            if held + reserve > cap:
                holders = sum(1 for c in self.clients.values() if c.held_bytes > 0 or c is client)
                share = cap // max(1, holders)
                if client.held_bytes + reserve > share:
                    return Refusal(f"engine output backlog full: {held} of {cap} bytes held for clients "
                                   f"(--max-backlog-bytes); this client holds {client.held_bytes}, over its fair "
                                   f"share of {share} (read results and acknowledge them)", None, 1.0,
                                   "rejected_backlog_bytes")
        return None

    def add(self, client: ClientRecord, record: RequestRecord) -> None:
        self.requests[record.rid] = record
        client.requests.add(record.rid)
        client.reserved_bytes += record.reserved_bytes

    # ------------------------------------------------------------------ bytes
    def sent(self, record: RequestRecord, nbytes: int, reserved: int) -> None:
        """`nbytes` of the request's outputs are on their way to its client, in place of
        `reserved` of its reservation; they are held until Delivered."""
        record.reserved_bytes -= reserved
        client = self.clients.get(record.identity)
        if client is None:
            return
        client.reserved_bytes -= reserved
        client.unacknowledged[record.client_request_id] = client.unacknowledged.get(record.client_request_id, 0) \
            + nbytes
        client.unacknowledged_bytes += nbytes

    def release(self, record: RequestRecord) -> None:
        """The request produces nothing more: the rest of its reservation comes back."""
        client = self.clients.get(record.identity)
        if client is not None:
            client.reserved_bytes -= record.reserved_bytes
        record.reserved_bytes = 0
        if record.input_bytes and self.input_bytes is not None:
            self.input_bytes.release(record.identity, record.input_bytes)
        record.input_bytes = 0

    def delivered(self, client: ClientRecord, client_request_id: str) -> None:
        client.unacknowledged_bytes -= client.unacknowledged.pop(client_request_id, 0)

    def forget(self, record: RequestRecord) -> None:
        """Drop the record once its final message is out and the core has its decode back
        (a partial image still in the decode stage refers to the record itself, not its id)."""
        if record.terminal and not record.in_decode:
            self.requests.pop(record.rid, None)
            client = self.clients.get(record.identity)
            if client is not None:
                client.requests.discard(record.rid)

    # ------------------------------------------------------------------ counts
    def live(self) -> list[RequestRecord]:
        return [r for r in self.requests.values() if not r.terminal]

    def waiting(self) -> int:
        return sum(1 for r in self.requests.values() if not r.started and not r.terminal)

    def held_bytes(self) -> int:
        return sum(c.held_bytes for c in self.clients.values())
