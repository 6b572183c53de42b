"""CBPE-style accuracy from the primary model's calibrated confidences (after NannyML's CBPE).

On the reference, the model's confidence is calibrated against the labels (isotonic regression), so
that a calibrated 0.8 is right 80% of the time; in a window, a row's chance of being right is its
calibrated confidence, and the window's expected accuracy is their mean. A binary model's P(class 1)
is calibrated (as NannyML does). A multiclass model's score of its predicted class is calibrated
against whether it was right (top-label calibration): NannyML calibrates each class one against the
rest and normalizes the calibrated scores to sum to 1, and where a change flattens every class's
score (the story's line 3 under dimmed lamps: the model's mean confidence 0.53 -> 0.45, true accuracy
0.68 -> 0.61) the normalization, dividing by a sum that fell too, raised the estimate (0.72 -> 0.81);
the predicted class's calibrated score falls with the confidence (0.70 -> 0.64). Right by
construction under covariate shift when the calibration holds (P(y|x) unchanged); blind, by design,
to concept shift, and biased under prior shift (the calibration's base rate is the reference's).
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
        self._calibrator = IsotonicRegression(y_min=0.0, y_max=1.0, out_of_bounds="clip")
        if self.classes == 2:  # calibrated P(0); P(1) = 1 - P(0)
            self._calibrator.fit(scores[:, 0], (labels == 0).astype(np.float64))
        else:  # calibrated P(the predicted class is right | its score)
            right = reference.outputs.predicted.astype(np.int64) == labels
            self._calibrator.fit(reference.outputs.confidence(), right.astype(np.float64))

    def row_correct_probability(self, outputs: Outputs) -> np.ndarray:
        """Each row's calibrated chance that the predicted class is right."""
        if self.classes != 2:
            return self._calibrator.predict(outputs.confidence())
        scores = outputs.class_scores()
        assert scores is not None
        p0 = self._calibrator.predict(scores[:, 0])
        return np.where(outputs.predicted.astype(np.int64) == 0, p0, 1.0 - p0)

    def estimate(self, outputs: Outputs) -> float:
        """The window's expected accuracy."""
        return float(np.mean(self.row_correct_probability(outputs)))
