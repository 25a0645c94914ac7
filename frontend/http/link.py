"""The gateway's connection to its engine: one `AsyncClient`, reconnected in the
background whenever there is none.

Requests never wait for a connection: without a live engine they get 503 at once
(and `/health` says 503), while one background task keeps trying to connect — at
start (the engine may still be loading its model) and after the engine died (a
supervisor may restart it at the same address). When the engine dies, every
in-flight request fails at once with the client's EngineDeadError, which the app
turns into 503.
"""
from __future__ import annotations

import asyncio
import logging
import time

from engine.protocol import Welcome
from frontend.client import AsyncClient, EngineDeadError
from frontend.http.errors import APIError, engine_unavailable

log = logging.getLogger("diffslot.http")


class EngineLink:
    def __init__(self, address: str | None, *, connect_timeout_s: float = 10.0, retry_interval_s: float = 0.5,
                 model_name: str | None = None, client_kwargs: dict | None = None):
        self.address = address
        self.connect_timeout_s = connect_timeout_s  # one handshake attempt
        self.retry_interval_s = retry_interval_s  # pause after a failed attempt
        self.model_name = model_name  # served name override; else the engine's Welcome.model
        self.client_kwargs = client_kwargs or {}  # passed on to frontend.Client
        self.welcome: Welcome | None = None  # of the last successful handshake
        self.created = int(time.time())
        self._client: AsyncClient | None = None
        self._connecting: asyncio.Task | None = None
        self._closed = False
        self._last_error = "not connected yet"

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

    async def client(self) -> AsyncClient:
        """The connected client; raises APIError(503) at once if there is none (and
        makes sure a background reconnect is under way)."""
        client = self._client
        if client is not None and client.client.alive:
            return client
        self.start()
        raise engine_unavailable(self._last_error)

    def lost(self, exc: BaseException) -> APIError:
        """The 503 for a request that failed because the engine died; reconnect."""
        self._last_error = str(exc) or type(exc).__name__
        self.start()
        return engine_unavailable(self._last_error)

    # ------------------------------------------------------------------ background
    async def _connect_loop(self) -> None:
        old, self._client = self._client, None
        if old is not None:  # a dead one: its IO thread is gone or going
            await old.__aexit__(None, None, None)
        while not self._closed:
            fresh = AsyncClient(self.address, connect_timeout=self.connect_timeout_s, name="diffslot-http",
                                **self.client_kwargs)
            try:
                await fresh.__aenter__()
            except asyncio.CancelledError:  # closing: stop the half-made client's IO thread too
                await asyncio.get_running_loop().run_in_executor(None, fresh.client.close)
                raise
            except (ConnectionError, EngineDeadError, OSError) as exc:
                self._last_error = str(exc) or type(exc).__name__
                log.debug("engine at %s not reachable: %s", self.address, self._last_error)
                await asyncio.sleep(self.retry_interval_s)
                continue
            if self._closed:
                await fresh.__aexit__(None, None, None)
                return
            self._client, self.welcome = fresh, fresh.client.welcome
            log.info("connected to engine %s (pid %d, model %s)", self.address, self.welcome.engine_pid,
                     self.welcome.model)
            return
