"""Prometheus metrics of the server: requests, latency, batch sizes, queue depth."""

from __future__ import annotations

import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class Metrics:
    """Prometheus metrics of one app, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "clef_guard_http_requests", "HTTP requests by route and status.", ["route", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "clef_guard_http_request_duration_seconds", "Time to answer, by route.", ["route"], registry=self.registry
        )
        self.batch_size = Histogram(
            "clef_guard_engine_batch_size", "Requests per engine batch.",
            buckets=(1, 2, 4, 8, 16, 32, 64), registry=self.registry,
        )
        self.queue_depth = Gauge("clef_guard_engine_queue_depth", "Requests waiting for a batch.", registry=self.registry)


class MetricsMiddleware:
    """Counts and times every HTTP request by route and status."""

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: Sequence[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = tuple(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        started = time.perf_counter()

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = scope["path"] if scope["path"] in self.routes else "other"
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - started)
