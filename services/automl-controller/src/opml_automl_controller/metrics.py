"""The controller's metrics: trials by how they ended and how long they ran, the sampler's ask
latency (the controller's own cost per trial), experiments by state, trials' models refused, trials'
upload grants revoked."""

from __future__ import annotations

from opml_automl_controller.state import ExperimentState, TrialState
from opml_common.metrics import ServiceMetrics

TRIAL_BUCKETS = (1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 24 * 3600)
ASK_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5)


class ControllerMetrics:
    """The hooks the controller and its trial runners call (no-ops: unit tests, benchmarks)."""

    def trial_ended(self, state: TrialState, seconds: float | None) -> None: ...
    def asked(self, seconds: float) -> None: ...
    def experiments(self, counts: dict[ExperimentState, int]) -> None: ...
    def spec_invalid(self) -> None: ...
    def model_refused(self) -> None: ...
    def leader(self, leading: bool) -> None: ...
    def grant_revocation(self, outcome: str) -> None: ...


class PrometheusControllerMetrics(ControllerMetrics):
    """``opml_automl_controller_trials_total{state}``, ``..._trial_duration_seconds{state}``,
    ``..._suggestion_seconds`` (one ``study.ask``), ``..._experiments{state}``, ``..._spec_invalid_total``,
    ``..._models_refused_total``, ``..._leader`` (1 in the replica that runs the experiments' loops) and
    ``..._upload_grant_revocations_total{outcome}`` (revoked, failed, dropped)."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self._trials = metrics.counter("trials_total", "Trials that ended, by how.", ("state",))
        self._duration = metrics.histogram("trial_duration_seconds", "From a trial's job submission to its end.",
                                           ("state",), buckets=TRIAL_BUCKETS)
        self._ask = metrics.histogram("suggestion_seconds", "Time of one suggestion (Optuna's ask, journal "
                                      "included).", buckets=ASK_BUCKETS)
        self._experiments = metrics.gauge("experiments", "Experiments known to the controller, by state.",
                                          ("state",))
        self._spec_invalid = metrics.counter("spec_invalid_total", "Stored experiments a list skipped: their "
                                             "katib_yaml breaks an admission rule made after they were created.")
        self._models_refused = metrics.counter("models_refused_total", "Best trials' models refused, not "
                                               "committed: no upload in the bundle-store, or one that is "
                                               "incomplete or over spec.model.maxBytes.")
        self._leader = metrics.gauge("leader", "1 while this replica holds the automl-controller lease and "
                                     "runs the experiments' loops, else 0.")
        self._revocations = metrics.counter(
            "upload_grant_revocations_total", "Revocations of ended trials' upload grants, by outcome: revoked; "
            "failed (the bundle-store refused or did not answer; retried at the next resync); dropped (the "
            "store says it can never be revoked: the context is gone).", ("outcome",))
        for outcome in ("revoked", "failed", "dropped"):
            self._revocations.labels(outcome)
        for state in TrialState:
            self._trials.labels(state.value)
        for state in ExperimentState:
            self._experiments.labels(state.value).set(0)

    def trial_ended(self, state: TrialState, seconds: float | None) -> None:
        self._trials.labels(state.value).inc()
        if seconds is not None:
            self._duration.labels(state.value).observe(max(0.0, seconds))

    def asked(self, seconds: float) -> None:
        self._ask.observe(seconds)

    def experiments(self, counts: dict[ExperimentState, int]) -> None:
        for state, count in counts.items():
            self._experiments.labels(state.value).set(count)

    def spec_invalid(self) -> None:
        self._spec_invalid.inc()

    def model_refused(self) -> None:
        self._models_refused.inc()

    def leader(self, leading: bool) -> None:
        self._leader.set(1 if leading else 0)

    def grant_revocation(self, outcome: str) -> None:
        self._revocations.labels(outcome).inc()
