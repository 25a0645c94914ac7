"""Who is calling the gateway, and how much each caller may ask.

* API keys (`--api-key`, repeatable, or DIFFSLOT_API_KEYS, comma-separated): every
  `/v1` route wants `Authorization: Bearer KEY`, else 401 in OpenAI's error shape.
  `/health` and `/metrics` stay open for probes and scrapers. Keys are compared as
  vLLM's server does: the SHA-256 of the presented token against the SHA-256 of
  every key with `hmac.compare_digest`, without stopping at a match, so the time
  taken tells neither a key's length nor which key matched.
* Callers: each key is its own caller; without keys each client address is one.
  A caller is what gets its own engine connection (`EngineLink.lease`), hence its
  own output budget and queue share on the engine, and its own rate bucket.
* Rate (`--rate-limit R`, requests per second per caller, 0 = off; `--rate-burst`):
  a token bucket per caller; a request without a token is 429 with Retry-After.
* Body size (`--max-body-bytes`, 1 MiB by default): a Content-Length over the limit
  is 413 before any of the body is read; a body without one (chunked) is counted as
  it streams in and refused as soon as it passes the limit, so no body is ever held
  whole beyond the limit.
* Body bytes held (`BodyBudget`): every chunk is counted against its caller's share
  (`--max-caller-body-bytes`) and all callers' (`--max-body-bytes-total`) before it
  is kept, and stays counted until its request has been answered; past a share the
  request is 429 (503 past the total), so slow or abandoned uploads hold at most their
  caller's share. A body that pauses `--body-timeout` between two chunks is 408.

`CallerGate` is a plain ASGI middleware doing the first three before any route runs
(so an unknown `/v1` route is 401 too); `read_body` is the body limit, called by the
route that reads a body.
"""
from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import math
import os
import time
from typing import Callable, Iterable

from starlette.requests import ClientDisconnect, Request

from frontend.http.errors import APIError, bad_request

API_KEYS_ENV = "DIFFSLOT_API_KEYS"
EDITS_PATH = "/v1/images/edits"
CALLER_SCOPE_KEY = "diffslot.caller"  # where CallerGate leaves the caller id in the ASGI scope
PROTECTED_PREFIX = "/v1"
RATE_BUCKETS = 10_000  # caller buckets remembered; full ones (equal to a fresh bucket) are forgotten first


def api_keys(flags: Iterable[str] | None = None, environ=os.environ) -> tuple[str, ...]:
    """The keys from `--api-key` flags and DIFFSLOT_API_KEYS, in order, without blanks or repeats."""
    keys = [*(flags or ()), *environ.get(API_KEYS_ENV, "").split(",")]
    return tuple(dict.fromkeys(key.strip() for key in keys if key.strip()))


class KeyRing:
    """The gateway's API keys; `caller(authorization)` is the caller id of a valid bearer token."""

    def __init__(self, keys: Iterable[str]):
        # a key's caller id is its position, never anything derived from the key itself; a key
        # is compared as the bytes it arrives as: HTTP header values are Latin-1 (ASGI servers
        # decode none), so a non-ASCII key counts as its UTF-8 bytes, which is what clients send
        self._digests = [(hashlib.sha256(key.encode("utf-8")).digest(), f"key#{i}") for i, key in enumerate(keys)]

    def __bool__(self) -> bool:
        return bool(self._digests)

    def caller(self, authorization: str | bytes | None) -> str | None:
        """`authorization`: the header's raw bytes (or text of them, read as Latin-1)."""
        raw = authorization or b""
        if isinstance(raw, str):
            try:
                raw = raw.encode("latin-1")
            except UnicodeEncodeError:  # not header text: a caller's own string
                raw = raw.encode("utf-8")
        scheme, _, token = raw.partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        presented = hashlib.sha256(token.strip()).digest()
        found = None
        for digest, caller in self._digests:  # every key, every time: no early exit
            if hmac.compare_digest(presented, digest):
                found = caller
        return found


class RateLimiter:
    """A token bucket per caller: `rate` tokens a second, at most `burst` banked."""

    def __init__(self, rate: float, burst: float | None = None, *, max_buckets: int = RATE_BUCKETS,
                 clock: Callable[[], float] = time.monotonic):
        self.rate = float(rate)
        self.burst = max(1.0, float(burst) if burst else self.rate)
        self.max_buckets = max_buckets
        self._clock = clock
        self._buckets: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()  # tokens, at

    def acquire(self, caller: str) -> float:
        """Take a token: 0.0 if there was one, else the seconds until there will be."""
        if self.rate <= 0:
            return 0.0
        now = self._clock()
        tokens, at = self._buckets.pop(caller, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        wait = 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.rate
        self._buckets[caller] = (tokens - 1.0 if wait == 0.0 else tokens, now)
        if len(self._buckets) > self.max_buckets:
            self._forget(now)
        return wait

    def _forget(self, now: float) -> None:
        """Drop buckets that have refilled (as good as new); then, if still too many, the
        least recently used (a caller cycling through more names than this gets a fresh
        bucket now and then: the memory stays bounded)."""
        refill_s = self.burst / self.rate
        for caller in [c for c, (_, at) in self._buckets.items() if now - at >= refill_s]:
            del self._buckets[caller]
        while len(self._buckets) > self.max_buckets:
            self._buckets.popitem(last=False)


def unauthorized() -> APIError:
    return APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer YOUR_KEY'.",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def rate_limited(wait_s: float, rate: float) -> APIError:
    headers = {"Retry-After": str(max(1, math.ceil(wait_s))), "retry-after-ms": str(max(1, round(wait_s * 1000)))}
    return APIError(429, f"Rate limit reached: {rate:g} requests per second per caller; retry after {wait_s:.2f}s.",
                    type="rate_limit_error", code="rate_limit_exceeded", headers=headers)


def too_large(limit: int) -> APIError:
    # Connection: close, so that the server drops the rest of the body instead of reading it
    return APIError(413, f"The request body is larger than this server's limit of {limit} bytes.",
                    code="request_too_large", headers={"Connection": "close"})


def request_timeout(idle_s: float) -> APIError:
    return APIError(408, f"The request body paused for more than {idle_s:g}s; send it without pauses.",
                    code="request_timeout", headers={"Connection": "close"})


class BodyBudget:
    """Request body bytes held, per caller and in all, counted as they arrive (before they
    are kept) until their request is answered. A caller holding nothing may always bring
    one body (its route's own limit bounds it)."""

    def __init__(self, per_caller: int, total: int, idle_timeout_s: float = 30.0):
        self.per_caller, self.total, self.idle_timeout_s = per_caller, total, idle_timeout_s
        self.held: collections.Counter = collections.Counter()
        self.held_total = 0
        self.refused = 0

    def take(self, caller: str, nbytes: int) -> APIError | None:
        mine = self.held[caller]
        if mine and self.per_caller and mine + nbytes > self.per_caller:
            self.refused += 1
            return APIError(429, f"Your requests' bodies already hold {mine} bytes on this server, its limit per "
                                 f"caller is {self.per_caller}; retry when they are done.", type="rate_limit_error",
                            code="too_many_body_bytes", headers={"Retry-After": "1", "Connection": "close"})
        if self.held_total and self.total and self.held_total + nbytes > self.total:
            self.refused += 1
            return APIError(503, f"This server holds {self.held_total} bytes of request bodies, its limit; retry "
                                 f"shortly.", type="service_unavailable", code="server_busy",
                            headers={"Retry-After": "1", "Connection": "close"})
        self.held[caller] = mine + nbytes
        self.held_total += nbytes
        return None

    def give_back(self, caller: str, nbytes: int) -> None:
        if nbytes <= 0:
            return
        self.held[caller] -= nbytes
        if self.held[caller] <= 0:
            del self.held[caller]
        self.held_total -= nbytes


BODY_SCOPE_KEY = "diffslot.body"  # the request's BodyHold, left in the ASGI scope by CallerGate


class BodyHold:
    """What one request's body holds of its caller's share; given back when it is answered."""

    def __init__(self, budget: BodyBudget, caller: str):
        self.budget, self.caller, self.nbytes = budget, caller, 0

    def take(self, nbytes: int) -> None:
        error = self.budget.take(self.caller, nbytes)
        if error is not None:
            raise error
        self.nbytes += nbytes

    def release(self) -> None:
        nbytes, self.nbytes = self.nbytes, 0
        self.budget.give_back(self.caller, nbytes)


def address_caller(scope) -> str:
    client = scope.get("client")
    return f"addr:{client[0] if client else 'unknown'}"


def caller_of(scope) -> str:
    """The caller id CallerGate gave this request (its client address where no gate ran)."""
    return scope.get(CALLER_SCOPE_KEY) or address_caller(scope)


class CallerGate:
    """ASGI middleware: authenticate `/v1` requests, name their caller, take a rate token,
    and refuse a declared Content-Length over the body limit before anything is read."""

    def __init__(self, app, keys: KeyRing, limiter: RateLimiter, max_body_bytes: int,
                 path_limits: dict[str, int] | None = None, bodies: BodyBudget | None = None):
        self.app, self.keys, self.limiter, self.max_body_bytes = app, keys, limiter, max_body_bytes
        self.path_limits = dict(path_limits or {})  # routes with their own body limit (the edits upload)
        self.bodies = bodies or BodyBudget(0, 0)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIX):
            return await self.app(scope, receive, send)
        headers = {}
        for name, value in scope.get("headers", ()):
            if name in (b"authorization", b"content-length"):
                headers[name] = value
        error = None
        if self.keys:
            caller = self.keys.caller(headers.get(b"authorization"))
            if caller is None:
                error = unauthorized()
        else:
            caller = address_caller(scope)
        if error is None:
            wait = self.limiter.acquire(caller)
            if wait > 0:
                error = rate_limited(wait, self.limiter.rate)
        if error is None and b"content-length" in headers:
            error = declared_length_error(headers[b"content-length"].decode("latin-1"),
                                          self.path_limits.get(scope["path"], self.max_body_bytes))
        if error is not None:
            error.headers.setdefault("Connection", "close")  # whatever body came stays unread
            return await error.response()(scope, receive, send)
        scope[CALLER_SCOPE_KEY] = caller
        hold = scope[BODY_SCOPE_KEY] = BodyHold(self.bodies, caller)
        try:
            await self.app(scope, receive, send)
        finally:
            hold.release()


def declared_length_error(value: str, limit: int) -> APIError | None:
    value = value.strip()
    if not value.isdigit():
        return bad_request("Invalid Content-Length header.", None, "invalid_header")
    return too_large(limit) if int(value) > limit else None


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as more than `limit` bytes have come in
    (CallerGate has already refused a declared Content-Length over it), each chunk counted
    against its caller's share of body bytes before it is kept (429 or 503 past a share),
    408 when it pauses longer than the body timeout. A client that goes away mid-body
    raises ClientDisconnect."""
    hold: BodyHold | None = request.scope.get(BODY_SCOPE_KEY)
    idle_s = hold.budget.idle_timeout_s if hold is not None else 0.0
    chunks, total = [], 0
    stream = request.stream().__aiter__()
    while True:
        try:
            chunk = await (asyncio.wait_for(stream.__anext__(), idle_s) if idle_s > 0 else stream.__anext__())
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            raise request_timeout(idle_s) from None
        total += len(chunk)
        if total > limit:
            raise too_large(limit)
        if hold is not None:
            hold.take(len(chunk))
        chunks.append(chunk)
    return b"".join(chunks)


__all__ = ["API_KEYS_ENV", "EDITS_PATH", "BodyBudget", "CallerGate", "ClientDisconnect", "KeyRing", "RateLimiter", "api_keys",
           "caller_of", "read_body"]
