"""A performance model of one environment (a pool kind): serving latency from the configuration.

Learnt on log latency, since configuration effects multiply (twice the batch, twice the work) and
relative error is what placement cares about. A tree ensemble, as the paper's regression trees,
captures the interactions without naming them; :mod:`.influence` names them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from sklearn.ensemble import GradientBoostingRegressor

from opml_common.errors import FailedPrecondition, InvalidArgument
from opml_common.perfmodel.space import OPTIONS, Sample, encode, log_latency


def tree_learner(seed: int = 0) -> GradientBoostingRegressor:
    """The learner of a full model (source, and the from-scratch baseline): boosted shallow trees."""
    return GradientBoostingRegressor(n_estimators=300, max_depth=3, learning_rate=0.05, subsample=0.8,
                                     random_state=seed)


class PerformanceModel:
    """Latency and throughput of configurations in one environment, learnt from its measurements."""

    def __init__(self, *, environment: str, seed: int = 0) -> None:
        self.environment = environment
        self._learner = tree_learner(seed)
        self._fitted = False

    def fit(self, samples: Sequence[Sample]) -> PerformanceModel:
        """Learns from measured ``samples``.

        Raises:
            InvalidArgument: fewer than 2 samples, or one without a positive latency.
        """
        if len(samples) < 2:
            raise InvalidArgument("samples", f"need at least 2 measurements, but got {len(samples)}")
        self._learner.fit(encode(samples), log_latency(samples))
        self._fitted = True
        return self

    def log_ms(self, samples: Sequence[Sample]) -> np.ndarray:
        """Predicted log latency (the feature a transfer learner builds on).

        Raises: FailedPrecondition before :meth:`fit`.
        """
        if not self._fitted:
            raise FailedPrecondition(f"the performance model of {self.environment} is not fitted yet")
        return self._learner.predict(encode(samples))

    def predict_ms(self, samples: Sequence[Sample]) -> np.ndarray:
        """Predicted mean batch latency in ms. Raises: FailedPrecondition before :meth:`fit`."""
        return np.exp(self.log_ms(samples))

    def predict_rps(self, samples: Sequence[Sample]) -> np.ndarray:
        """Predicted rows per second of one replica. Raises: FailedPrecondition before :meth:`fit`."""
        return np.asarray([s.config.batch for s in samples]) * 1000.0 / self.predict_ms(samples)

    def option_importances(self) -> dict[str, float]:
        """Each option's share of the trees' impurity reduction (sums to 1), largest first.

        Raises: FailedPrecondition before :meth:`fit`.
        """
        if not self._fitted:
            raise FailedPrecondition(f"the performance model of {self.environment} is not fitted yet")
        pairs = zip(OPTIONS, self._learner.feature_importances_, strict=True)
        return dict(sorted(((name, float(value)) for name, value in pairs), key=lambda p: -p[1]))


def mape(predicted: np.ndarray, actual: np.ndarray) -> float:
    """Mean absolute percentage error, in percent.

    Raises: InvalidArgument when the arrays differ in length, are empty, or ``actual`` is not positive.
    """
    predicted, actual = np.asarray(predicted, dtype=float), np.asarray(actual, dtype=float)
    if predicted.shape != actual.shape or actual.size == 0 or not np.all(actual > 0):
        raise InvalidArgument("actual", f"needs {predicted.size} positive values, but got {actual.size}")
    return float(np.mean(np.abs(predicted - actual) / actual) * 100.0)
