"""The instrument page and its JSON API, served on loopback.

The page (``page.html`` beside this module) is self-contained: inline script and SVG,
nothing external. It talks to :class:`engine.instrument.state.Instrument` through

    GET  /                 the page
    GET  /api/state        the instrument's state (see engine.instrument.state)
    POST /api/reset        reset; returns the state
    POST /api/rates        body {"arrival": "4", "service": "3"} (numbers or decimal
                           strings); returns the state, or 400 {"error": ...}
    GET  /api/predict?t=2  predict; returns the state (with "prediction")
    POST /api/step         advance t by 0.5; returns the state
    GET  /api/run          the --from-run comparison ({"configs": []} without one)
"""
from __future__ import annotations

import functools
import ipaddress
import json
import socket
from fractions import Fraction
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.resources import files
from typing import Any
from urllib.parse import parse_qs, urlsplit

from engine.instrument.fluid import LIMITS
from engine.instrument.formatting import fmt
from engine.instrument.state import Instrument

__all__ = ["InstrumentServer", "make_server", "is_loopback", "page_template"]

_MAX_BODY = 64 * 1024


@functools.cache
def page_template() -> str:
    """page.html, with the placeholders __LIMITS__, __ARRIVAL__ and __SERVICE__."""
    return files("engine.instrument").joinpath("page.html").read_text(encoding="utf-8")


_LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}


def is_loopback(host: str) -> bool:
    h = host.strip("[]").lower()
    if h in _LOOPBACK_NAMES or h.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


class _Handler(BaseHTTPRequestHandler):
    server: "InstrumentServer"
    server_version = "diffslot-queue-instrument"
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # noqa: A002 - signature fixed by the base class
        if self.server.verbose:
            super().log_message(format, *args)

    # -- helpers
    def _send(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header(
            "Content-Security-Policy",
            "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
            "connect-src 'self'; img-src data:",
        )
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, obj: Any, status: int = 200) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json")

    def _error(self, status: int, msg: str) -> None:
        self._json({"error": msg}, status)

    def _host_ok(self) -> bool:
        if self.server.allow_remote:
            return True
        host = self.headers.get("Host", "")
        name = host.rsplit(":", 1)[0] if not host.startswith("[") else host.split("]")[0] + "]"
        if is_loopback(name):
            return True
        self._error(HTTPStatus.FORBIDDEN, "the instrument answers loopback host names only")
        return False

    def _body(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        if n > _MAX_BODY:
            raise ValueError("request body too large")
        raw = self.rfile.read(n) if n else b""
        if not raw:
            return {}
        return json.loads(raw)

    # -- verbs
    def do_HEAD(self):  # noqa: N802
        self.do_GET()

    def do_GET(self):  # noqa: N802
        if not self._host_ok():
            return
        url = urlsplit(self.path)
        inst = self.server.instrument
        if url.path in ("/", "/index.html"):
            self._send(200, self.server.page, "text/html; charset=utf-8")
        elif url.path == "/api/state":
            self._json(inst.state())
        elif url.path == "/api/predict":
            qs = parse_qs(url.query)
            if "t" not in qs:
                self._error(400, "predict needs ?t=")
                return
            try:
                self._json(inst.predict(qs["t"][0]))
            except ValueError as e:
                self._error(400, str(e))
        elif url.path == "/api/run":
            self._json(inst.run_json)
        elif url.path == "/favicon.ico":
            self._send(204, b"", "image/x-icon")
        else:
            self._error(404, f"no such resource: {url.path}")

    def do_POST(self):  # noqa: N802
        if not self._host_ok():
            return
        url = urlsplit(self.path)
        inst = self.server.instrument
        try:
            body = self._body()
        except (ValueError, json.JSONDecodeError) as e:
            self._error(400, f"bad request body: {e}")
            return
        try:
            if url.path == "/api/reset":
                self._json(inst.reset())
            elif url.path == "/api/rates":
                if not isinstance(body, dict) or "arrival" not in body or "service" not in body:
                    self._error(400, 'rates need {"arrival": ..., "service": ...}')
                    return
                self._json(inst.set_rates(body["arrival"], body["service"]))
            elif url.path == "/api/step":
                self._json(inst.step())
            else:
                self._error(404, f"no such resource: {url.path}")
        except ValueError as e:
            self._error(400, str(e))


class InstrumentServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr, instrument: Instrument, *, allow_remote=False, verbose=False):
        if ":" in addr[0]:
            self.address_family = socket.AF_INET6
        self.instrument = instrument
        self.allow_remote = allow_remote
        self.verbose = verbose
        q = instrument.queue
        self.page = (
            page_template().replace("__LIMITS__", _html_escape(LIMITS))
            .replace("__ARRIVAL__", fmt(q.arrival))
            .replace("__SERVICE__", fmt(q.service))
            .encode("utf-8")
        )
        super().__init__(addr, _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{port}/"


def _html_escape(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def make_server(host="127.0.0.1", port=0, *, arrival=0, service=0, run=None,
                tolerance=Fraction(1), allow_remote=False, verbose=False) -> InstrumentServer:
    if not allow_remote and not is_loopback(host):
        raise ValueError(f"refusing to serve on non-loopback host {host!r} (pass --allow-remote)")
    return InstrumentServer((host, port), Instrument(arrival, service, run, tolerance),
                            allow_remote=allow_remote, verbose=verbose)
