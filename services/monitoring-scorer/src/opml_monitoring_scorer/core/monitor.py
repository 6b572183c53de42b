"""One monitored model version: its estimators, fitted once from the reference, and a window's score.

The quality score of a window is the product of its parts, each in [0, 1]:

- ``performance``: the MPP's estimate against the reference's own metric (accuracy ratio, or the
  reference MAE over the estimated MAE for regression), capped at 1; absent without reference labels;
- ``drift``: 1 - half the share of features whose drift test fired (the features of the window's rows,
  and the ``summary:<tensor>.<stat>`` statistics of its summary-only predictions: summary.py);
- ``output``: 1 - half the output distribution's distance (the predicted class or value);
- ``data_quality``: 1 - the share of rows with a data-quality problem (a summary-only prediction's
  rows count as bad when its summary shows one).

A window of summary-only predictions only is scored on drift and data quality: no MPP or CBPE
estimate (they need rows), flagged ``no_estimate:summary_only`` where the model has them.

So a clean window scores near 1, a window where the model is estimated at 80% of its reference
accuracy scores 0.8 at most, and every part is reported beside the score.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from opml_common.errors import InvalidArgument
from opml_monitoring_scorer.core.cbpe import ConfidenceEstimator
from opml_monitoring_scorer.core.config import MonitoringConfig
from opml_monitoring_scorer.core.decode import Batch
from opml_monitoring_scorer.core.drift import ColumnDrift, DriftSuite, FeatureDrift
from opml_monitoring_scorer.core.mpp import MPP
from opml_monitoring_scorer.core.quality import DataQuality, QualityChecker
from opml_monitoring_scorer.core.reference import ReferenceSet, Task, is_categorical, performance
from opml_monitoring_scorer.core.summary import SummaryDrift

OUTPUT = "__output__"
CONFIDENCE = "__confidence__"


@dataclass
class WindowScore:
    """The scores of one closed window (``true`` and ``labelled`` grow as labels arrive)."""

    index: int
    rows: int
    first_time: float
    last_time: float
    score: float
    parts: dict[str, float]
    mpp: float | None
    cbpe: float | None
    drift: dict[str, FeatureDrift]
    output_drift: FeatureDrift | None
    confidence_drift: FeatureDrift | None
    data_quality: DataQuality
    true: float | None = None
    labelled: int = 0
    flags: list[str] = field(default_factory=list)
    mpp_labels: int | None = None
    """The live labelled rows the MPP that estimated it was fitted on (0: the reference's own model;
    None: no MPP estimate). Recalibrations run in the background: a window closed while one runs is
    scored by the model in use."""

    def signals(self) -> dict[str, float | None]:
        """What alert rules read."""
        return {"score": self.score, "mpp": self.mpp, "cbpe": self.cbpe, "true": self.true,
                "data_quality": self.data_quality.bad_rows_share}

    def drift_signals(self) -> dict[str, tuple[float, bool]]:
        return {name: (d.distance, d.drifted) for name, d in self.drift.items()}


class ModelMonitor:
    """Estimators of one model version. Without reference labels there is no MPP or CBPE: drift and
    data quality only (``limitations`` says so)."""

    def __init__(self, reference: ReferenceSet, config: MonitoringConfig, *, seed: int = 0,
                 quality: QualityChecker | None = None) -> None:
        """``quality``: the value ranges rows are checked against (default: ``reference``'s; a segment's
        monitor keeps its version's: the data-quality rule's bound is written for the whole reference's
        row count, and fewer rows make narrower ranges that flag more clean rows)."""
        self.reference = reference
        self.config = config
        self.task = reference.task
        self.limitations: list[str] = []
        self.drift = DriftSuite(reference.features, methods=config.drift_methods,
                                thresholds=config.drift_thresholds, categorical=sorted(reference.categorical))
        self.quality = quality if quality is not None else QualityChecker(reference.features)
        self.summary_drift = SummaryDrift(reference.features, config.feature_names, methods=config.drift_methods,
                                          thresholds=config.drift_thresholds, seed=seed)
        output_is_category = self.task is not Task.REGRESSION
        self.output_drift = ColumnDrift(OUTPUT, reference.outputs.predicted.astype(object).astype(str)
                                        if output_is_category else reference.outputs.predicted,
                                        categorical=output_is_category)
        confidence = reference.outputs.confidence()
        self.confidence_drift = ColumnDrift(CONFIDENCE, confidence) if confidence is not None else None
        self.reference_performance = reference.performance()
        self.mpp: MPP | None = None
        self.cbpe: ConfidenceEstimator | None = None
        if reference.has_labels:
            self.mpp = MPP(reference, seed=seed)
            if self.task is not Task.REGRESSION:
                self.cbpe = ConfidenceEstimator(reference)
        else:
            self.limitations.append("the reference has no labels: no performance estimate (MPP, CBPE), "
                                    "drift and data quality only")

    def check(self, batch: Batch) -> None:
        """Checks a prediction's rows against the reference when it arrives: a column of another kind
        or scores of another width would pass the decode and break every estimator at the window's
        close, again on every replay.

        Raises:
            InvalidArgument: a feature is categorical where the reference's is numeric, or the other
                way, or the scores hold another number of classes than the reference's.
        """
        problems = []
        for name, column in batch.features.items():
            reference = self.reference.features.get(name)
            if reference is not None and is_categorical(column) != is_categorical(reference):
                kinds = ("categorical", "numeric") if is_categorical(column) else ("numeric", "categorical")
                problems.append((f"features.{name}", f"is {kinds[0]}, but the reference's is {kinds[1]}"))
        classes, expected = batch.outputs.classes, self.reference.outputs.classes  # shapes: called per record
        if classes is not None and expected is not None and classes != expected:
            problems.append(("infer_response.outputs", f"hold scores of {classes} classes, but the "
                                                      f"reference's have {expected}"))
        if problems:
            raise InvalidArgument.of(problems)

    def score(self, batch: Batch, *, index: int, first_time: float, last_time: float) -> WindowScore:
        """Scores one window's rows."""
        rows = len(batch)
        quality = self.quality.check(batch.features, rows, summary_only=batch.summary_only,
                                     summaries=batch.summaries, tensors=self.summary_drift.ranges)
        drift = self.drift.measure(batch.features) if rows else {}
        flags = quality.flags()
        if batch.summaries:
            summary_drift, unscored = self.summary_drift.measure(batch.summaries)
            drift.update(summary_drift)
            flags.extend(f"summary_unscored:{tensor}" for tensor in unscored)
            if not rows and self.mpp is not None:
                flags.append("no_estimate:summary_only")
        mpp = mpp_labels = cbpe = output = confidence = None
        if rows:
            if self.mpp is not None:
                mpp, mpp_labels = self.mpp.scored(batch.features, batch.outputs)
            if self.cbpe is not None and batch.outputs.scores is not None:
                cbpe = self.cbpe.estimate(batch.outputs)
            predicted = batch.outputs.predicted
            output = self.output_drift.measure(predicted.astype(object).astype(str)
                                               if self.task is not Task.REGRESSION else predicted)
            if self.confidence_drift is not None and batch.outputs.scores is not None:
                confidence = self.confidence_drift.measure(batch.outputs.confidence())
        parts: dict[str, float] = {}
        if mpp is not None and self.reference_performance is not None:
            if self.task is Task.REGRESSION:
                parts["performance"] = min(1.0, self.reference_performance / max(mpp, 1e-12))
            else:
                parts["performance"] = min(1.0, mpp / max(self.reference_performance, 1e-12))
        if drift:
            parts["drift"] = 1.0 - 0.5 * sum(d.drifted for d in drift.values()) / len(drift)
        if output is not None:
            parts["output"] = 1.0 - 0.5 * min(1.0, output.distance)
        parts["data_quality"] = 1.0 - quality.bad_rows_share if rows or batch.summaries else 0.0
        score = float(np.prod(list(parts.values())))
        return WindowScore(index=index, rows=rows, first_time=first_time, last_time=last_time, score=score,
                           parts=parts, mpp=mpp, cbpe=cbpe, drift=drift, output_drift=output,
                           confidence_drift=confidence, data_quality=quality, flags=flags, mpp_labels=mpp_labels)

    def truth(self, batch: Batch, labels: np.ndarray) -> float:
        """The true metric of labelled rows (accuracy, or MAE for regression)."""
        return performance(self.task, batch.outputs.predicted, np.asarray(labels, dtype=np.float64))
