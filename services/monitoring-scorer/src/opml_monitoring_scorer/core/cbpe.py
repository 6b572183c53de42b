"""CBPE-style accuracy from the primary model's calibrated confidences (after NannyML's CBPE).

On the reference, each class's score is calibrated against the labels (isotonic regression, one
against the rest; NannyML calibrates the same way), so that a calibrated 0.8 is right 80% of the
time. In a window, a row's chance of being right is then the calibrated probability of the class
the model predicted, and the window's expected accuracy is their mean. Right by construction under
covariate shift when the calibration holds (P(y|x) unchanged); blind, by design, to concept shift,
and biased under prior shift (the calibration's base rate is the reference's).
"""

from __future__ import annotations

import numpy as np
from sklearn.isotonic import IsotonicRegression

from opml_common.errors import FailedPrecondition
from opml_monitoring_scorer.core.reference import Outputs, ReferenceSet, Task


class ConfidenceEstimator:
    """Calibrators fitted on a labelled reference of a classifier.

    Raises:
        FailedPrecondition: the reference has no labels, no scores, or is a regression model's.
    """

    def __init__(self, reference: ReferenceSet) -> None:
        if reference.task is Task.REGRESSION:
            raise FailedPrecondition("CBPE estimates classifiers only (regression has the MPP's error model)")
        scores = reference.outputs.class_scores()
        if reference.labels is None or scores is None:
            raise FailedPrecondition("CBPE needs the reference's labels and class scores")
        labels = reference.labels.astype(np.int64)
        self.classes = scores.shape[1]
        self._calibrators = []
        for k in range(self.classes):
            calibrator = IsotonicRegression(y_min=0.0, y_max=1.0, out_of_bounds="clip")
            calibrator.fit(scores[:, k], (labels == k).astype(np.float64))
            self._calibrators.append(calibrator)
            if self.classes == 2:  # one calibrator is the whole story: P(0) = 1 - P(1)
                break

    def calibrated(self, outputs: Outputs) -> np.ndarray:
        """Calibrated class probabilities [n, classes], rows summing to 1."""
        scores = outputs.class_scores()
        assert scores is not None
        if self.classes == 2:
            p1 = self._calibrators[0].predict(scores[:, 0])  # calibrated P(0)
            return np.column_stack([p1, 1.0 - p1])
        columns = np.column_stack([c.predict(scores[:, k]) for k, c in enumerate(self._calibrators)])
        totals = columns.sum(axis=1, keepdims=True)
        uniform = np.full_like(columns, 1.0 / self.classes)
        return np.where(totals > 0, columns / np.where(totals > 0, totals, 1.0), uniform)

    def row_correct_probability(self, outputs: Outputs) -> np.ndarray:
        """Each row's calibrated chance that the predicted class is right."""
        probabilities = self.calibrated(outputs)
        index = np.clip(outputs.predicted.astype(np.int64), 0, self.classes - 1)
        return probabilities[np.arange(len(index)), index]

    def estimate(self, outputs: Outputs) -> float:
        """The window's expected accuracy."""
        return float(np.mean(self.row_correct_probability(outputs)))
