"""The workers' metrics on the router's own /metrics: one endpoint for Prometheus to scrape.

Each worker process serves ``opml_inference_router_worker_*`` on a port of its own, picked at random
and announced on its stdout, so no static scrape config can name it, and in a pod or container those
ports are not exposed. :class:`WorkerMetricsCollector`, registered on the router's registry, reads
every live worker's /metrics when Prometheus scrapes the router (concurrently, each with a short
timeout), parses it and yields its ``opml_inference_router_worker_*`` families with ``worker`` and
``pool_kind`` labels added, so compose, Kubernetes and `make up` need nothing beyond the router's
target. A worker that does not answer (restarting, stuck) is left out of that scrape and counted in
``opml_inference_router_worker_scrape_errors_total{worker}``.

What is left out of a worker's page: families outside the worker namespace (``process_*``,
``python_*``: the router exports its own under the same names) and any family whose name the router
registers itself (``opml_inference_router_worker_restarts_total``, the scrape errors), so no name is
ever exported twice; and ``*_created`` series, which no panel charts.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from opml_common.metrics import ServiceMetrics

log = logging.getLogger(__name__)

WORKER_PREFIX = "opml_inference_router_worker_"
ERRORS = "worker_scrape_errors_total"  # the router's own, after its prefix
ADDED_LABELS = ("worker", "pool_kind")


@dataclass(frozen=True)
class WorkerEndpoint:
    """Where one live worker serves /metrics, and the labels its series get on the router's page."""

    worker: str
    pool_kind: str
    url: str


def pool_endpoints(pools) -> Callable[[], list[WorkerEndpoint]]:
    """The live workers of a :class:`~opml_inference_router.control.pools.PoolManager`, read at each
    scrape (a restarted worker has a new metrics port; a dead one is skipped, not counted as an error)."""

    def endpoints() -> list[WorkerEndpoint]:
        found = []
        for pool_worker in pools.workers():
            if pool_worker.process is None:  # a host's worker: its host exposes its metrics
                continue
            port = pool_worker.process.metrics_port
            if pool_worker.alive and port:
                found.append(WorkerEndpoint(pool_worker.worker.id, pool_worker.worker.kind.name,
                                            f"http://127.0.0.1:{port}/metrics"))
        return found

    return endpoints


class WorkerMetricsCollector:
    """A prometheus_client custom collector re-exporting the workers' families with their labels.

    ``collect()`` blocks for at most about ``timeout_s`` (workers are read in parallel, at most
    ``max_parallel`` at a time). Called on a thread running an asyncio loop (the router's Observer
    reads the registry there), it yields nothing: reading workers over HTTP would stall serving, and
    no reader on the loop wants workers' series.

    It also yields ``opml_inference_router_worker_scrape_errors_total{worker}`` (a series per known
    worker from 0, so a panel shows that none failed instead of no data).

    Side effects: ``register()`` adds it to ``metrics.registry``.
    """

    def __init__(self, endpoints: Callable[[], Sequence[WorkerEndpoint]], metrics: ServiceMetrics, *,
                 timeout_s: float = 1.0, max_parallel: int = 8, known_workers: Iterable[str] = (),
                 reserved: Callable[[], Iterable[str]] | None = None,
                 fetch: Callable[[str, float], str] | None = None) -> None:
        """``known_workers``: ids whose error series start at 0; ``reserved``: names the router registers
        itself (default: read from ``metrics.registry``); ``fetch(url, timeout_s)``: a page's text.

        Raises: ValueError naming the bad argument.
        """
        if timeout_s <= 0:
            raise ValueError(f"`timeout_s` must be > 0, but got {timeout_s}")
        if max_parallel < 1:
            raise ValueError(f"`max_parallel` must be >= 1, but got {max_parallel}")
        self._endpoints = endpoints
        self._registry = metrics.registry
        self._timeout_s = timeout_s
        self._max_parallel = max_parallel
        self._reserved = reserved or (lambda: registered_names(self._registry))
        self._fetch = fetch or _http_get
        # Yielded by collect() after the reads (not registered apart), so a failure shows in the same scrape.
        self._errors = Counter(metrics.prefix + ERRORS, "Workers' /metrics that did not answer a scrape of the "
                               "router (their series are missing from that scrape).", ("worker",), registry=None)
        self._known_workers = tuple(known_workers)
        self._warned: set[str] = set()

    def register(self) -> WorkerMetricsCollector:
        for worker in self._known_workers:
            self._errors.labels(worker)
        self._registry.register(self)
        return self

    def describe(self) -> list[Metric]:
        """Nothing: the families are known only by reading the workers, which registering must not do."""
        return []

    def collect(self) -> Iterator[Metric]:
        if not _on_event_loop():
            yield from self._workers_families()
        yield from self._errors.collect()

    def _workers_families(self) -> Iterator[Metric]:
        endpoints = list(self._endpoints())
        if not endpoints:
            return
        pages = self._read(endpoints)
        own = list(self._errors.collect())
        reserved = {*self._reserved(), *(f.name for f in own), *(s.name for f in own for s in f.samples)}
        merged: dict[str, Metric] = {}
        for endpoint, text in pages:
            try:
                families = list(text_string_to_metric_families(text))
            except Exception as error:  # noqa: BLE001 - a garbled page is that worker's failure, not the scrape's
                self._failed(endpoint, f"unparsable /metrics ({error})")
                continue
            for family in families:
                if not family.name.startswith(WORKER_PREFIX) or family.name.endswith("_created"):
                    continue
                if family.name in reserved or any(s.name in reserved for s in family.samples):
                    self._clash(family.name)
                    continue
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                into.samples.extend(_relabelled(sample, endpoint) for sample in family.samples)
        yield from merged.values()

    def _read(self, endpoints: list[WorkerEndpoint]) -> list[tuple[WorkerEndpoint, str]]:
        def read(endpoint: WorkerEndpoint) -> tuple[WorkerEndpoint, str | None]:
            try:
                return endpoint, self._fetch(endpoint.url, self._timeout_s)
            except Exception as error:  # noqa: BLE001 - skipped and counted; the router's page still answers
                self._failed(endpoint, str(error) or type(error).__name__)
                return endpoint, None

        if len(endpoints) == 1:
            results = [read(endpoints[0])]
        else:
            with ThreadPoolExecutor(min(self._max_parallel, len(endpoints)), thread_name_prefix="worker-metrics") as pool:
                results = list(pool.map(read, endpoints))
        return [(endpoint, text) for endpoint, text in results if text is not None]

    def _failed(self, endpoint: WorkerEndpoint, reason: str) -> None:
        self._errors.labels(endpoint.worker).inc()
        log.warning("worker %s's metrics at %s left out of this scrape: %s", endpoint.worker, endpoint.url, reason)

    def _clash(self, name: str) -> None:
        if name not in self._warned:
            self._warned.add(name)
            log.warning("worker family %s is also the router's own; the workers' series of it are not re-exported",
                        name)


def _relabelled(sample: Sample, endpoint: WorkerEndpoint) -> Sample:
    """The sample with the worker's labels; a label of the same name it had is kept as ``exported_<label>``
    (what Prometheus does when a target's labels clash with its own)."""
    labels = dict(sample.labels)
    for name, value in (("worker", endpoint.worker), ("pool_kind", endpoint.pool_kind)):
        if name in labels:
            labels[f"exported_{name}"] = labels[name]
        labels[name] = value
    return sample._replace(labels=labels)


def registered_names(registry: CollectorRegistry) -> set[str]:
    """The names the registry's collectors registered (prometheus_client keeps them to refuse duplicates;
    it has no public accessor, so an unknown version reads as none reserved)."""
    names = getattr(registry, "_names_to_collectors", None)
    return set(names) if isinstance(names, dict) else set()


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _http_get(url: str, timeout_s: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read().decode()


def register_worker_metrics(pools, metrics: ServiceMetrics, **options: object) -> WorkerMetricsCollector:
    """Re-export the workers of ``pools`` on the router's /metrics (the one line ``__main__`` calls)."""
    known = [pool_worker.worker.id for pool_worker in pools.workers()]
    return WorkerMetricsCollector(pool_endpoints(pools), metrics, known_workers=known, **options).register()
