"""Byzantine-robust aggregation: coordinate-wise trimmed mean (Yin et al., 2018) and coordinate-wise
median (Flower's ``FedTrimmedAvg`` and ``FedMedian``). Both ignore the example counts: one client
claiming many examples must not be able to pull the model."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from opml_fl_coordinator.strategy.base import FitRes
from opml_fl_coordinator.strategy.fedavg import FedAvg
from opml_fl_coordinator_contract.weights import Weights


class FedTrimmedAvg(FedAvg):
    """Per coordinate, drop the ``beta`` fraction of largest and of smallest values, average the rest.

    Raises:
        ValueError: ``beta`` outside [0, 0.5) (and FedAvg's rules).
    """

    def __init__(self, *, beta: float = 0.2, **kwargs) -> None:
        super().__init__(**kwargs)
        if not isinstance(beta, (int, float)) or isinstance(beta, bool) or not 0 <= beta < 0.5:
            raise ValueError(f"beta must be a number in [0, 0.5), but got {beta!r}")
        self.beta = float(beta)

    def combine(self, results: Sequence[FitRes]) -> Weights:
        cut = int(self.beta * len(results))
        combined = []
        for i in range(len(results[0].weights)):
            stacked = np.sort(np.stack([np.asarray(r.weights[i], np.float64) for r in results]), axis=0)
            combined.append(np.mean(stacked[cut:len(results) - cut], axis=0))
        return combined


class FedMedian(FedAvg):
    """Per coordinate, the median of the clients' values."""

    def combine(self, results: Sequence[FitRes]) -> Weights:
        return [np.median(np.stack([np.asarray(r.weights[i], np.float64) for r in results]), axis=0)
                for i in range(len(results[0].weights))]
