"""The gateway's own Prometheus metrics (the engine exports its own on --metrics-port).

A pure ASGI middleware counts every HTTP request by route and status and times it
(to the end of its body: a stream's whole life); the images route adds its
outcome per image. Each app has its own registry, so several gateways (tests, Ray
replicas) in one process never collide.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

ROUTES = frozenset({"/v1/images/generations", "/v1/images/edits", "/v1/models", "/v1/files", "/v1/batches",
                    "/health", "/metrics"})
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("diffslot_http_requests", "HTTP requests by route and status code",
                                ["route", "status"], registry=r)
        self.latency = Histogram("diffslot_http_request_duration_seconds",
                                 "HTTP request latency, to the end of the response body", ["route"],
                                 buckets=_BUCKETS, registry=r)
        self.in_flight = Gauge("diffslot_http_requests_in_flight", "HTTP requests being served", registry=r)
        self.images = Counter("diffslot_http_images", "Images requested of the engine, by outcome "
                              "(completed, rejected, busy, failed, canceled, engine_dead, client_gone)",
                              ["outcome"], registry=r)
        self.partial_images = Counter("diffslot_http_partial_images", "Preview images streamed", registry=r)
        self.batch_lines = Counter("diffslot_http_batch_lines", "Batch job lines this gateway finished, by outcome "
                                   "(completed, failed)", ["outcome"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Counts and times every HTTP request; cheap (no BaseHTTPMiddleware, no extra task)."""

    def __init__(self, app, metrics: GatewayMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in ROUTES else "other"
        status = [500]

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        started = time.perf_counter()
        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(route, str(status[0])).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - started)
