"""The gateway's connections to its engine: one main `AsyncClient`, reconnected in the
background whenever there is none, and one connection per caller.

Requests never wait for a connection: without a live engine they get 503 at once
(and `/health` says 503), while one background task keeps trying to connect — at
start (the engine may still be loading its model) and after the engine died (a
supervisor may restart it at the same address). When the engine dies, every
in-flight request fails at once with the client's EngineDeadError, which the app
turns into 503.

The main connection answers `/v1/models` and `/health` (its Welcome names the model
and the budgets) and watches for a drain. Images are generated on the caller's own
connection (`lease(caller)`): the engine fences its clients from each other — an
output budget each (`Welcome.output_budget_bytes`), a fair share of the engine-wide
backlog, `--max-queue-per-client` — so one connection per caller gives every caller
those shares, where one shared connection would make all HTTP callers compete for one
budget. At most `max_callers` caller connections are held; one without requests for
`caller_idle_s` is closed (a returning caller reconnects in a few milliseconds), and
when all are busy a new caller gets 429 until one frees.

Draining: an engine that got SIGTERM rejects new work ("engine shutting down") until
it exits. `draining()` tells `/health`, from the engine's `draining` stat (asked at
most every `drain_poll_s`) and from any such rejection seen, so that a load balancer
stops routing here before the engine is gone.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import logging
import time

from engine.protocol import Rejected, Welcome
from frontend.async_client import AsyncClient
from frontend.client import EngineDeadError
from frontend.http.errors import APIError, engine_unavailable
from frontend.http.options import LinkOptions

log = logging.getLogger("diffslot.http")

#: how often the gateway says it is still waiting for its engine
WAITING_LOGGED_EVERY_S = 10.0
#: threads for the link's blocking calls: a handshake or a round trip each, at most this many at once
LINK_THREADS = 8

#: the phrase of the engine's Rejected reason while it drains (engine.serve.proc)
SHUTTING_DOWN = "shutting down"
#: the flag the engine names when it refuses a Hello past its client limit (engine.serve.io_thread)
CLIENT_LIMIT = "--max-clients"


class _CallerConnection:
    """A caller's own engine connection: made once, shared by that caller's requests."""

    def __init__(self, connecting: asyncio.Task):
        self.connecting = connecting  # resolves to the connected AsyncClient
        self.client: AsyncClient | None = None
        self.leases = 0  # requests using it now: never closed while > 0
        self.last_used = time.monotonic()

    @property
    def dead(self) -> bool:
        """Its engine is gone, or its handshake failed: a fresh one is needed."""
        if self.client is None:
            return self.connecting.done() and (self.connecting.cancelled() or self.connecting.exception() is not None)
        return not self.client.client.alive


class CallerLease:
    """A request's hold on its caller's connection; `release()` (idempotent) when done."""

    def __init__(self, link: "EngineLink", caller: str, connection: _CallerConnection):
        self.link, self.caller, self.client = link, caller, connection.client
        self._connection: _CallerConnection | None = connection

    def release(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.leases -= 1
            connection.last_used = time.monotonic()
            self.link._close_idle()


class EngineLink:
    def __init__(self, address: str | None, *, connect_timeout_s: float = LinkOptions.connect_timeout_s,
                 retry_interval_s: float = 0.5, model_name: str | None = LinkOptions.model_name,
                 client_kwargs: dict | None = None, max_callers: int = LinkOptions.max_callers,
                 caller_idle_s: float = 60.0, drain_poll_s: float = 1.0, drain_poll_timeout_s: float = 0.5):
        self.address = address
        self.connect_timeout_s = connect_timeout_s  # one handshake attempt
        self.retry_interval_s = retry_interval_s  # pause after a failed attempt
        self.model_name = model_name  # served name override; else the engine's Welcome.model
        self.client_kwargs = client_kwargs or {}  # passed on to frontend.Client
        self.max_callers = max_callers  # caller connections held at once
        self.caller_idle_s = caller_idle_s  # an unused caller connection is closed after this
        self.drain_poll_s = drain_poll_s  # the engine's `draining` stat is asked at most this often
        self.drain_poll_timeout_s = drain_poll_timeout_s  # a step in progress delays the answer: keep the last
        self.welcome: Welcome | None = None  # of the last successful handshake
        self.created = int(time.time())
        self._client: AsyncClient | None = None
        self._connecting: asyncio.Task | None = None
        self._closed = False
        self._last_error = "not connected yet"  # for the log; clients are told less
        self._callers: collections.OrderedDict[str, _CallerConnection] = collections.OrderedDict()  # LRU first
        self._closing: set[asyncio.Task] = set()  # caller connections being closed
        self._draining = False  # of the engine behind the main connection
        self._drain_polled_at = float("-inf")
        # the link's own threads for its blocking calls (handshakes, round trips, closes), so that
        # nothing else the app runs in threads delays a health probe's answer or a reconnect
        self.executor = concurrent.futures.ThreadPoolExecutor(LINK_THREADS, thread_name_prefix="diffslot-link")
        self._adapters_call: asyncio.Future | None = None

    # ------------------------------------------------------------------ state
    @property
    def connected(self) -> bool:
        return self._client is not None and self._client.client.alive

    @property
    def models(self) -> tuple[str, ...]:
        """Names a request's `model` may use: the served name first, then aliases."""
        if self.model_name:
            names = [self.model_name]
        elif self.welcome is not None and self.welcome.model:
            names = [self.welcome.model.rstrip("/").rsplit("/", 1)[-1], self.welcome.model]
        else:
            names = ["diffslot"]
        return tuple(dict.fromkeys(names + ["diffslot"]))

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Begin connecting in the background (idempotent)."""
        if self._closed or self.connected or (self._connecting is not None and not self._connecting.done()):
            return
        self._connecting = asyncio.ensure_future(self._connect_loop())

    async def wait_connected(self, timeout_s: float) -> bool:
        """Start connecting and wait up to `timeout_s` for the handshake."""
        self.start()
        deadline = time.monotonic() + timeout_s
        while not self.connected and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.connected

    async def close(self) -> None:
        self._closed = True
        if self._connecting is not None:
            self._connecting.cancel()
            try:
                await self._connecting
            except BaseException:  # noqa: BLE001 - cancelled or failed: either way it is over
                pass
        client, self._client = self._client, None
        if client is not None:
            await client.__aexit__(None, None, None)
        for caller in list(self._callers):
            self._drop(caller)
        while self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        self.executor.shutdown(wait=False)

    async def client(self) -> AsyncClient:
        """The main connection; raises APIError(503) at once if there is none (and makes
        sure a background reconnect is under way)."""
        client = self._client
        if client is not None and client.client.alive:
            return client
        self.start()
        log.debug("no engine connection: %s", self._last_error)
        raise engine_unavailable(self._public_reason())

    def lost(self, exc: BaseException) -> APIError:
        """The 503 for a request that failed because the engine died; reconnect."""
        self._last_error = str(exc) or type(exc).__name__
        log.warning("engine connection lost: %s", self._last_error)
        self.start()
        return engine_unavailable("the connection to the engine was lost; reconnecting")

    def _public_reason(self) -> str:
        """Why there is no engine, without addresses or exception texts (those are logged)."""
        return "not connected yet" if self.welcome is None else "the engine is not reachable; reconnecting"

    # ------------------------------------------------------------------ callers
    async def lease(self, caller: str) -> CallerLease:
        """The caller's own connection, made on first use; 503 at once without an engine,
        429 when `max_callers` connections are all busy."""
        await self.client()
        connection = self._callers.get(caller)
        if connection is not None and connection.dead:  # the engine it spoke to is gone, or it never connected
            self._drop(caller)
            connection = None
        if connection is None:
            self._close_idle(room_for_one=True)
            if len(self._callers) >= self.max_callers:
                raise APIError(429, f"this server is serving {self.max_callers} callers at once, its limit; "
                                    f"retry shortly", type="rate_limit_error", code="too_many_callers",
                               headers={"Retry-After": "1"})
            connection = _CallerConnection(asyncio.ensure_future(self._connect_caller(caller)))
            self._callers[caller] = connection
        self._callers.move_to_end(caller)
        connection.leases += 1
        lease = CallerLease(self, caller, connection)
        try:
            if connection.client is None:  # shielded: the caller's other requests wait on it too
                connection.client = lease.client = await asyncio.shield(connection.connecting)
        except BaseException:
            lease.release()
            if connection.connecting.done() and self._callers.get(caller) is connection:
                self._drop(caller)  # the handshake failed: the next request tries afresh
            raise
        return lease

    async def _connect_caller(self, caller: str) -> AsyncClient:
        client = AsyncClient(self.address, connect_timeout=self.connect_timeout_s, name=f"diffslot-http {caller}",
                             executor=self.executor, **self.client_kwargs)
        try:
            await client.__aenter__()
        except asyncio.CancelledError:  # closing: stop the half-made client's IO thread too
            await asyncio.get_running_loop().run_in_executor(self.executor, client.client.close)
            raise
        except (ConnectionError, EngineDeadError, OSError) as exc:
            log.warning("engine connection for caller %s failed: %s", caller, exc)
            if CLIENT_LIMIT in str(exc):  # the engine is up, with as many clients as it takes
                raise APIError(503, "the diffslot engine serves as many clients as it takes (its --max-clients); "
                                    "retry shortly", type="service_unavailable", code="engine_client_limit",
                               headers={"Retry-After": "1"}) from None
            raise engine_unavailable("the engine is not reachable; reconnecting") from None
        return client

    def _close_idle(self, room_for_one: bool = False) -> None:
        """Close caller connections unused for `caller_idle_s`, and dead ones; with
        `room_for_one`, also the least recently used idle ones until one more fits."""
        now = time.monotonic()
        for caller, connection in list(self._callers.items()):
            if connection.leases == 0 and (connection.dead or now - connection.last_used > self.caller_idle_s):
                self._drop(caller)
        if room_for_one:
            for caller, connection in list(self._callers.items()):  # least recently used first
                if len(self._callers) < self.max_callers:
                    break
                if connection.leases == 0 and connection.client is not None:
                    self._drop(caller)

    def _drop(self, caller: str) -> None:
        connection = self._callers.pop(caller)
        task = asyncio.ensure_future(self._close_connection(connection))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    @staticmethod
    async def _close_connection(connection: _CallerConnection) -> None:
        if not connection.connecting.done():
            connection.connecting.cancel()
        try:
            client = await connection.connecting
        except BaseException:  # noqa: BLE001 - it never connected: nothing to close
            return
        await client.__aexit__(None, None, None)

    @property
    def callers(self) -> int:
        """Caller connections held now."""
        return len(self._callers)

    async def adapters(self) -> list[str]:
        """The engine's adapters now: one round trip at a time, its answer shared by every
        request that asked while it was under way (a burst of /v1/models costs one)."""
        client = await self.client()
        if self._adapters_call is None or self._adapters_call.done():
            self._adapters_call = asyncio.ensure_future(client.adapters())
        return await asyncio.shield(self._adapters_call)

    # ------------------------------------------------------------------ draining
    def saw_rejection(self, result: Rejected) -> None:
        """Note a drain the engine announced by rejecting a request."""
        if SHUTTING_DOWN in result.reason and result.retry_after_s > 0:
            self._draining = True

    async def draining(self) -> bool:
        """Whether the engine behind the main connection is draining (after SIGTERM)."""
        client = self._client
        now = time.monotonic()
        if self._draining or client is None or now - self._drain_polled_at < self.drain_poll_s:
            return self._draining
        self._drain_polled_at = now
        stats = functools.partial(client.client.stats, timeout=self.drain_poll_timeout_s)
        try:
            answer = await asyncio.get_running_loop().run_in_executor(self.executor, stats)
        except (TimeoutError, ConnectionError, RuntimeError):  # busy in a step, or gone: the link says which
            return self._draining
        if client is self._client:  # still the same engine
            self._draining = bool(answer.get("draining"))
        return self._draining

    # ------------------------------------------------------------------ background
    async def _connect_loop(self) -> None:
        old, self._client = self._client, None
        if old is not None:  # a dead one: its IO thread is gone or going
            await old.__aexit__(None, None, None)
        waiting_since, told_at = time.monotonic(), float("-inf")
        while not self._closed:
            fresh = AsyncClient(self.address, connect_timeout=self.connect_timeout_s, name="diffslot-http",
                                executor=self.executor, **self.client_kwargs)
            try:
                await fresh.__aenter__()
            except asyncio.CancelledError:  # closing: stop the half-made client's IO thread too
                await asyncio.get_running_loop().run_in_executor(self.executor, fresh.client.close)
                raise
            except (ConnectionError, EngineDeadError, OSError) as exc:
                self._last_error = str(exc) or type(exc).__name__
                now = time.monotonic()
                if now - told_at >= WAITING_LOGGED_EVERY_S:  # visible, without a line per retry
                    told_at = now
                    log.info("waiting for the engine at %s (%.0fs so far; retrying every %gs): %s", self.address,
                             now - waiting_since, self.retry_interval_s, self._last_error)
                else:
                    log.debug("engine at %s not reachable: %s", self.address, self._last_error)
                await asyncio.sleep(self.retry_interval_s)
                continue
            if self._closed:
                await fresh.__aexit__(None, None, None)
                return
            self._client, self.welcome = fresh, fresh.client.welcome
            self._draining, self._drain_polled_at = False, float("-inf")  # a new engine, perhaps
            log.info("connected to engine %s (pid %d, model %s)", self.address, self.welcome.engine_pid,
                     self.welcome.model)
            return
