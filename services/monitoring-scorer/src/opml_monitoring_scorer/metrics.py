"""The scorer's Prometheus metrics, per model and version (``opml_monitoring_scorer_*``)."""

from __future__ import annotations

from opml_common.metrics import ServiceMetrics

WINDOW_CLOSE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ScorerMetrics:
    def __init__(self, metrics: ServiceMetrics) -> None:
        mv = ("model", "version")
        # window-level series per segment too ("": the version as a whole; at most MAX_SEGMENTS + other
        # per version, core/segments.py)
        mvs = ("model", "version", "segment")
        self.predictions = metrics.counter("predictions_total", "Predictions scored, per model version.", mv)
        self.rejected = metrics.counter(
            "predictions_rejected_total", "Predictions dead-lettered: "
            "malformed (the event or its KServe v2 messages do not decode, or disagree with the reference), "
            "untrusted (its event source is not a prediction producer: OPML_MONITORING_SCORER_PREDICTION_SOURCES), "
            "unscorable (the records of a window the estimators failed on).", ("reason",))
        self.skipped = metrics.counter(
            "predictions_skipped_total", "Valid predictions not scored: unknown_model (a version nobody registered: "
            "served outside the platform, or its deployment not seen yet).", ("reason",))
        self.windows = metrics.counter("windows_total", "Windows closed and scored.", mvs)
        self.score = metrics.gauge("window_score", "Quality score of the last closed window (0..1).", mvs)
        self.estimate = metrics.gauge(
            "estimate", "Performance of the last window: estimator mpp or cbpe (label-free), or true (labels); "
            "accuracy, or MAE for regression.", (*mvs, "estimator"))
        self.estimate_error = metrics.gauge(
            "estimate_error_abs", "|estimate - true| of the last window with labels, per estimator.", (*mvs, "estimator"))
        self.drift = metrics.gauge("feature_drift_distance", "Drift distance of each feature in the last window "
                                   "(normed Wasserstein or Jensen-Shannon).", (*mvs, "feature"))
        self.drifted = metrics.gauge("features_drifted", "Features whose drift test fired in the last window.", mvs)
        self.data_quality = metrics.gauge("data_quality_bad_share", "Share of the last window's rows with a "
                                          "data-quality problem.", mvs)
        self.alerts = metrics.counter("alerts_total", "Alerts raised and resolved.", (*mvs, "rule", "change"))
        self.firing = metrics.gauge("alerts_firing", "1 while a rule's alert is raised.", (*mvs, "rule"))
        self.close_seconds = metrics.histogram(
            "window_close_seconds", "From a window's close to its score saved and its alerts emitted.", mvs,
            buckets=WINDOW_CLOSE_BUCKETS)
        self.labels = metrics.counter("labels_total", "Labels by outcome: joined, parked (before its "
                                      "prediction), corrected (its producer's again with a newer time and "
                                      "other values: replaced), duplicate (the same event again, not newer, or "
                                      "the same values), other_producer "
                                      "(the request was labelled by another producer: the first kept), untrusted "
                                      "(from a producer the model does not accept: dead-lettered), malformed, "
                                      "unjoinable (its version had no monitor yet).", ("outcome",))
        self.labels_submitted = metrics.counter("labels_submitted_total", "Labels published through SubmitLabels "
                                                "(opml monitor label), under the platform's label source.")
        self.recalibrations = metrics.counter("mpp_recalibrations_total", "MPP recalibrations from live labels that "
                                                   "changed its secondary model (a refit better out of fold).", mv)
        self.recalibration_labels = metrics.gauge(
            "mpp_recalibration_labels", "Live labelled rows the MPP had taken when its last finished "
            "recalibration started (recalibrations run in the background: the labels after it wait for the next).",
            mv)
        self.recalibration_failures = metrics.counter(
            "mpp_recalibration_failures_total", "MPP recalibrations that failed (the version's or one of its "
            "segments'): the model in use is kept and the refit is tried again by itself, after a wait that "
            "doubles with each failure in a row (from OPML_MONITORING_SCORER_MPP_REFIT_QUIET_S, up to 300 s).", mv)
        self.registered = metrics.gauge("models_monitored", "Model versions monitored.")
        self.segment_other = metrics.counter(
            "segment_other_predictions_total", "Predictions put in the segment other: their segment parameter's "
            "value came after the version's MAX_SEGMENTS (64) segments, was longer than 64 characters, or "
            "neither a string nor an integer.", mv)
        for reason in ("malformed", "untrusted", "unscorable"):  # series at 0 from the start: a rate, not a gap
            self.rejected.labels(reason)
        self.skipped.labels("unknown_model")
        for outcome in ("joined", "parked", "corrected", "duplicate", "other_producer", "untrusted", "malformed"):
            self.labels.labels(outcome)
