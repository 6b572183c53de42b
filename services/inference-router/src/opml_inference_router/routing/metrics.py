"""The router's Prometheus metrics; labelled children are resolved once per model version, not per request."""

from __future__ import annotations

from prometheus_client import Counter

from opml_common.metrics import ServiceMetrics
from opml_inference_router.routing.replicas import LOCAL_SITE, ReplicaState
from opml_inference_router.routing.window import OutcomeWindow


class RouterMetrics:
    """``opml_inference_router_*`` routing metrics of one process."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self.requests = metrics.counter("requests_total", "Inference requests, by model, version and status code.",
                                        ("model", "version", "code"))
        self.duration = metrics.histogram("request_duration_seconds",
                                          "Inference latency at the router, admission to response.",
                                          ("model", "version"))
        self.backups = metrics.counter("backup_requests_total",
                                       "Backup (hedged) requests sent to a second replica.", ("model", "version"))
        self.backup_wins = metrics.counter("backup_wins_total", "Backup requests that answered first.",
                                           ("model", "version"))
        self.retries = metrics.counter("retries_total", "Requests retried on another replica after a failure.",
                                       ("model", "version"))
        self.waits = metrics.counter("replica_waits_total", "Times a request found no routable replica of its "
                                     "version (every one down or ejected) and waited for one to come back.",
                                     ("model", "version"))
        self.shed = metrics.counter("shed_total", "Requests refused with RESOURCE_EXHAUSTED, by reason "
                                    "(queue_full, deadline, slo).", ("model", "reason"))
        self.outstanding = metrics.gauge("replica_outstanding_requests", "Requests in flight per replica.",
                                         ("model", "version", "replica"))
        self.ejections = metrics.counter("replica_ejections_total", "Replicas taken out of rotation after a failure.",
                                         ("model", "version", "replica"))
        self.site_answers = metrics.counter("site_answers_total", "Inference requests answered, by the site of "
                                            "the replica that answered (local: the router's own).",
                                            ("model", "version", "site"))
        self.traffic_ratio = metrics.gauge("traffic_ratio", "Share of a model's traffic (requests naming no "
                                           "version) each of its versions takes, 0..1: a rollout's weights.",
                                           ("model", "version"))
        self._shared: dict[str, set[str]] = {}  # model -> versions with a traffic_ratio series

    def traffic(self, model: str, shares: dict[str, float]) -> None:
        """The model's versions' shares now; a version left out (forgotten, or the model removed) loses its series."""
        for version in self._shared.pop(model, set()) - set(shares):
            try:
                self.traffic_ratio.remove(model, version)
            except KeyError:
                pass
        for version, share in shares.items():
            self.traffic_ratio.labels(model, version).set(share)
        if shares:
            self._shared[model] = set(shares)

    def version(self, model: str, version: str) -> VersionMetrics:
        return VersionMetrics(self, model, version)


class VersionMetrics:
    """The children of one model version, looked up once, and its :class:`OutcomeWindow` (what a
    progressive rollout reads)."""

    def __init__(self, owner: RouterMetrics, model: str, version: str) -> None:
        self._owner, self.model, self.version = owner, model, version
        self.ok = owner.requests.labels(model, version, "OK")
        self.duration = owner.duration.labels(model, version)
        self.backups = owner.backups.labels(model, version)
        self.backup_wins = owner.backup_wins.labels(model, version)
        self.retries = owner.retries.labels(model, version)
        self.waits = owner.waits.labels(model, version)
        self.window = OutcomeWindow()
        self._sites: dict[str, Counter] = {}  # site -> its site_answers child, resolved on its first answer

    def answered(self, seconds: float, site: str = LOCAL_SITE) -> None:
        child = self._sites.get(site)
        if child is None:
            child = self._sites[site] = self._owner.site_answers.labels(self.model, self.version, site)
        child.inc()
        self.ok.inc()
        self.duration.observe(seconds)
        self.window.answered(seconds)

    def failed(self, code: str) -> None:
        self._owner.requests.labels(self.model, self.version, code).inc()
        self.window.failed(code)

    def ejected(self, replica: str) -> None:
        self._owner.ejections.labels(self.model, self.version, replica).inc()

    def track(self, state: ReplicaState) -> None:
        """Export ``state.outstanding`` as a gauge read at scrape time (no cost per request)."""
        self._owner.outstanding.labels(self.model, self.version, state.name).set_function(lambda: state.outstanding)

    def untrack(self, state: ReplicaState) -> None:
        try:
            self._owner.outstanding.remove(self.model, self.version, state.name)
        except KeyError:
            pass
