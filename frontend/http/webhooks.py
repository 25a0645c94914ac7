"""Webhooks: a signed POST when a batch ends, as OpenAI sends them.

The body is OpenAI's event (`{"id": "evt_…", "object": "event", "created_at", "type":
"batch.completed" | "batch.failed" | "batch.cancelled" | "batch.expired", "data": {"id":
batch id}}`), signed the Standard Webhooks way, which OpenAI's SDKs check
(`client.webhooks.unwrap(body, headers, secret=…)`):

    webhook-id: evt_…            (the same on every retry: receivers deduplicate by it)
    webhook-timestamp: <unix seconds of this attempt>
    webhook-signature: v1,<base64 HMAC-SHA256 over "id.timestamp.body">

with the secret's bytes (a `whsec_` secret is base64 after the prefix, as OpenAI's).
Any 2xx is delivered; anything else (an error status, a refused or timed out
connection) is retried after 1, 2, 4 … × the backoff (capped at 5 minutes), at most
`attempts` times, then given up and logged.
"""
from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import os
import secrets
import time
import urllib.error
import urllib.request

log = logging.getLogger("diffslot.http")

WEBHOOK_SECRET_ENV = "DIFFSLOT_WEBHOOK_SECRET"
MAX_BACKOFF_S = 300.0
EVENT_TYPES = {"completed": "batch.completed", "failed": "batch.failed", "cancelled": "batch.cancelled",
               "expired": "batch.expired"}


def webhook_secret(secret_file: str | None, environ=os.environ) -> str | None:
    """The signing secret: the file's first line, else DIFFSLOT_WEBHOOK_SECRET; None: no webhooks."""
    if secret_file:
        with open(secret_file, encoding="utf-8") as f:
            secret = f.readline().strip()
        if not secret:
            raise ValueError(f"--webhook-secret-file {secret_file}: the file is empty")
        return secret
    return environ.get(WEBHOOK_SECRET_ENV, "").strip() or None


def secret_bytes(secret: str) -> bytes:
    return base64.b64decode(secret[len("whsec_"):]) if secret.startswith("whsec_") else secret.encode()


def sign(secret: str, webhook_id: str, timestamp: int, body: bytes) -> str:
    signed = f"{webhook_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(secret_bytes(secret), signed, hashlib.sha256).digest()).decode()


def batch_event(batch_id: str, status: str, event_id: str | None = None) -> tuple[str, bytes]:
    """(event id, body) of the event for a batch that ended with `status`."""
    event_id = event_id or f"evt_{secrets.token_hex(12)}"
    body = json.dumps({"id": event_id, "object": "event", "created_at": int(time.time()),
                       "type": EVENT_TYPES[status], "data": {"id": batch_id}}).encode()
    return event_id, body


def _post(url: str, body: bytes, headers: dict[str, str], timeout_s: float) -> int:
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"content-type": "application/json", "user-agent": "diffslot-webhooks",
                                              **headers})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 - operator-allowed URLs
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


class WebhookSender:
    def __init__(self, secret: str, *, attempts: int = 8, backoff_s: float = 1.0, timeout_s: float = 10.0):
        self.secret, self.attempts, self.backoff_s, self.timeout_s = secret, max(1, attempts), backoff_s, timeout_s

    async def deliver(self, url: str, event_id: str, body: bytes) -> tuple[bool, int]:
        """POST until a 2xx or `attempts` tries: (delivered, attempts made)."""
        for attempt in range(1, self.attempts + 1):
            timestamp = int(time.time())
            headers = {"webhook-id": event_id, "webhook-timestamp": str(timestamp),
                       "webhook-signature": sign(self.secret, event_id, timestamp, body)}
            try:
                status = await asyncio.to_thread(_post, url, body, headers, self.timeout_s)
                why = f"status {status}"
            except (OSError, ValueError) as exc:  # refused, unreachable, timed out, a bad URL
                status, why = None, f"{type(exc).__name__}: {exc}"
            if status is not None and 200 <= status < 300:
                return True, attempt
            if attempt < self.attempts:
                delay = min(MAX_BACKOFF_S, self.backoff_s * 2 ** (attempt - 1))
                log.info("webhook %s to %s: attempt %d failed (%s); again in %.1fs", event_id, url, attempt, why,
                         delay)
                await asyncio.sleep(delay)
            else:
                log.warning("webhook %s to %s: giving up after %d attempts (last: %s)", event_id, url, attempt, why)
        return False, self.attempts
