"""Prometheus metrics of the engine process, served on 127.0.0.1 only.

Per-request service times are histograms fed as requests finish; engine-wide
numbers are gauges copied from `EngineCore.stats()` (whatever numeric keys it
reports, as `diffslot_core_<key>`) and from the process's own bookkeeping.
Only the busy loop writes; the HTTP server thread only reads.
"""
from __future__ import annotations

import logging
import re

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from engine.protocol import Timings

log = logging.getLogger("diffslot.engine")

_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class EngineMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._server = None
        r = self.registry
        self.requests = Counter("diffslot_requests", "Finished requests by outcome", ["outcome"], registry=r)
        self.seconds = {
            name: Histogram(f"diffslot_request_{name}", f"Per-request {name.replace('_s', '')} time, seconds",
                            buckets=_SECONDS_BUCKETS, registry=r)
            for name in ("queue_s", "encode_s", "image_encode_s", "denoise_s", "decode_wait_s", "decode_s", "total_s")
        }
        self.evals = Counter("diffslot_evals", "Denoiser rows of finished requests", ["kind"], registry=r)
        self.canceled_evals = Counter("diffslot_canceled_evals", "Denoiser rows spent on requests later canceled",
                                      registry=r)
        self.process = {
            name: Gauge(f"diffslot_{name}", help_text, registry=r)
            for name, help_text in (
                ("clients", "Connected clients"),
                ("requests_in_flight", "Accepted requests without a final answer yet"),
                ("undelivered_output_bytes", "Output bytes reserved or sent but not acknowledged by clients"),
                ("outbound_backlog_messages", "Messages held back for clients whose pipes are full"),
            )
        }
        self._gauges: dict[str, Gauge] = {}
        # read at scrape time (the HTTP server's thread), so it moves even while a step hangs
        self.step_running = Gauge("diffslot_step_running_seconds",
                                  "How long the denoising step in progress has run (0: none); the watchdog ends the "
                                  "engine past --step-timeout", registry=r)

    def watch_step(self, seconds) -> None:
        """`seconds()`: how long the current step has run, 0 when none."""
        self.step_running.set_function(seconds)

    def start_server(self, port: int) -> None:
        self._server, _ = start_http_server(port, addr="127.0.0.1", registry=self.registry)
        log.info("metrics on http://127.0.0.1:%d/metrics", port)

    def stop_server(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def finished(self, outcome: str, timings: Timings | None = None) -> None:
        self.requests.labels(outcome).inc()
        if timings is None:
            return
        if outcome == "canceled":
            self.canceled_evals.inc(timings.evals)
            return
        for name, histogram in self.seconds.items():
            histogram.observe(getattr(timings, name))
        self.evals.labels("useful").inc(timings.evals)
        self.evals.labels("padded").inc(timings.padded_evals)

    def refresh(self, core_stats: dict, process_stats: dict) -> None:
        for name, gauge in self.process.items():
            gauge.set(process_stats.get(name, 0))
        self._copy("diffslot_core_", "EngineCore.stats()", core_stats)
        # the decode stage's counters and the preview decodes, from the process's stats
        self._copy("diffslot_", "engine process stats", {k: v for k, v in process_stats.items()
                                                         if k not in self.process and k != "pid"})

    def _copy(self, prefix: str, source: str, stats: dict) -> None:
        for key, value in stats.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            name = prefix + re.sub(r"[^a-zA-Z0-9_]", "_", key)
            gauge = self._gauges.get(name)
            if gauge is None:
                gauge = self._gauges[name] = Gauge(name, f"{source}[{key!r}]", registry=self.registry)
            gauge.set(value)
