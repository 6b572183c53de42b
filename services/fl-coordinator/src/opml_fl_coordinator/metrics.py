"""The coordinator's Prometheus metrics (``opml_fl_coordinator_*``).

Reasons become a small set of label values (:func:`kind_of`), never the free text, so label
cardinality stays bounded whatever clients send.
"""

from __future__ import annotations

from opml_common.metrics import ServiceMetrics

ROUND_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 900, 3600)
_KINDS = (("upload refused", "upload"), ("deadline", "deadline"), ("left the federation", "left"),
          ("client reported", "failed"), ("shapes", "shape"), ("floating point", "dtype"), ("NaN", "nonfinite"), ("num_examples", "examples"),
          ("max_update_norm", "norm"), ("median", "outlier"), ("stale", "stale"), ("current task", "late"))
DROP_KINDS = ("deadline", "left", "failed")
REJECT_KINDS = ("shape", "dtype", "nonfinite", "examples", "norm", "outlier", "stale", "late", "upload", "other")


def kind_of(reason: str) -> str:
    for needle, kind in _KINDS:
        if needle in reason:
            return kind
    return "other"


class FlMetrics:
    def __init__(self, metrics: ServiceMetrics) -> None:
        self.rounds = metrics.counter("rounds_total", "Rounds (aggregations) completed.", ("mode",))
        self.round_seconds = metrics.histogram("round_duration_seconds", "Time from a round's start to its "
                                               "aggregation.", ("mode",), buckets=ROUND_BUCKETS)
        self.updates = metrics.counter("updates_accepted_total", "Client updates accepted for aggregation.")
        self.rejected = metrics.counter("updates_rejected_total", "Client updates refused, by reason.", ("reason",))
        self.metrics_dropped = metrics.counter("update_metrics_dropped_total", "Metrics of client updates left "
                                               "out because they are not finite (the update is still taken).")
        self.dropped = metrics.counter("clients_dropped_total", "Selected clients whose update is not in their "
                                       "round, by reason.", ("reason",))
        self.federations = metrics.gauge("federations", "Federations by state.", ("state",))
        self.clients = metrics.gauge("clients_present", "Clients joined and present, over all federations.")
        self.accuracy = metrics.gauge("global_accuracy_ratio", "Accuracy of each federation's latest global "
                                      "model.", ("federation",))
        self.bytes_in = metrics.counter("weights_received_bytes_total", "Array bytes uploaded by clients.")
        self.bytes_out = metrics.counter("weights_sent_bytes_total", "Array bytes sent: tasks to members, DownloadWeights.")
        self.save_seconds = metrics.histogram("state_save_seconds", "Time to save a completed round (S3 + Redis).")
        for mode in ("sync", "semi_async"):
            self.rounds.labels(mode)
            self.round_seconds.labels(mode)
        for kind in REJECT_KINDS:
            self.rejected.labels(kind)
        for kind in DROP_KINDS:
            self.dropped.labels(kind)
        for state in ("waiting", "running", "completed", "stopped"):
            self.federations.labels(state)
