"""The worker's serving metrics, ``opml_inference_router_worker_*``, and counters for ModelStatistics."""

from __future__ import annotations

from dataclasses import dataclass, field

from opml_common.metrics import ServiceMetrics

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class WorkerMetrics:
    """Prometheus collectors shared by every replica of a worker, labelled by model and version.

    ``metrics`` is the worker's own ``ServiceMetrics("inference-router-worker")``, so these and the
    worker's RPC metrics never mix with the router's ``opml_inference_router_*`` ones.
    """

    def __init__(self, metrics: ServiceMetrics) -> None:
        self.latency = metrics.histogram(
            "inference_duration_seconds", "Time from a request's arrival at its replica's queue to its "
            "result (queue wait + batch run).", ("model", "version"))
        self.batch_size = metrics.histogram(
            "batch_size", "Requests' rows per batch run (before padding to a fixed shape).",
            ("model", "version"), buckets=BATCH_BUCKETS)
        self.queue_depth = metrics.gauge(
            "queue_depth", "Requests waiting for a batch.", ("model", "version"))
        self.replicas = metrics.gauge("replicas", "Model replicas loaded (slots in use).")
        self.memory = metrics.gauge("replica_memory_mib", "Memory of the loaded replicas.")

    def for_replica(self, model: str, version: int) -> ReplicaMetrics:
        labels = (model, str(version))
        return ReplicaMetrics(self.latency.labels(*labels), self.batch_size.labels(*labels),
                              self.queue_depth.labels(*labels))

    def forget(self, model: str, version: int) -> None:
        """Drops an unloaded replica's series so the worker's /metrics does not grow with every deploy."""
        for collector in (self.latency, self.batch_size, self.queue_depth):
            try:
                collector.remove(model, str(version))
            except KeyError:
                pass


@dataclass
class BatchStats:
    """Successful batches of one size: how many and their total run time (Triton's InferBatchStatistics)."""

    count: int = 0
    ns: int = 0


@dataclass
class ReplicaMetrics:
    """One replica's children of the worker's collectors, plus the counts ModelStatistics reports."""

    latency: object
    batch_size: object
    queue_depth: object
    inference_count: int = 0
    execution_count: int = 0
    success_ns: int = 0
    failures: int = 0
    last_inference_ms: int = 0
    batches: dict[int, BatchStats] = field(default_factory=dict)
