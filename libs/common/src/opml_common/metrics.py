"""Prometheus metrics named ``opml_<service>_<what>_<unit>`` and the /metrics endpoint."""

from __future__ import annotations

import re

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class ServiceMetrics:
    """Creates one service's metrics with the ``opml_<service>_`` prefix, once per name.

    Asking twice for the same name returns the same collector, so components that share a
    process (a servicer and its bus consumer) share metrics instead of clashing in the registry.
    """

    def __init__(self, service: str, registry: CollectorRegistry = REGISTRY) -> None:
        self.service = service
        self.prefix = "opml_" + re.sub(r"[^a-z0-9]+", "_", service.lower()).strip("_") + "_"
        self.registry = registry
        self._collectors: dict[str, object] = {}

    def counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return self._get(Counter, name, doc, labels)

    def gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return self._get(Gauge, name, doc, labels)

    def histogram(self, name: str, doc: str, labels: tuple[str, ...] = (),
                  buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
        return self._get(Histogram, name, doc, labels, buckets=buckets)

    def _get(self, kind: type, name: str, doc: str, labels: tuple[str, ...], **kwargs: object):
        full = self.prefix + name
        if full not in self._collectors:
            self._collectors[full] = kind(full, doc, labels, registry=self.registry, **kwargs)
        return self._collectors[full]


def serve_metrics(host: str, port: int, registry: CollectorRegistry = REGISTRY) -> int:
    """Start the /metrics HTTP endpoint in a daemon thread; returns the bound port."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server.server_port
