"""Learning a target environment's model from a few of its measurements, with or without a source model.

Three ways, as the paper compares them, and the baseline they are measured against:

- :class:`ModelShift`: the target is a linear function of the source's prediction (in log latency:
  a constant factor and an exponent). Two samples suffice; it keeps the source's shape.
- :class:`ScaleShift`: the model shift with the exponent fixed at 1: the source's prediction times
  the median ratio the target's samples show. One parameter, and a median, so a few samples taken
  while a shared machine was busy do not bend it (an outlier can tilt a fitted exponent far).
- :class:`InfluenceTransfer`: a small ridge model on the source's prediction plus only the source's
  most influential terms (:mod:`.influence`), so a few samples can correct how the target differs
  in those terms without having to rediscover which matter.
- :class:`FromScratch`: the target learnt alone (trees as the source model, or ridge on every main
  effect and pairwise interaction): the baseline.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol

import numpy as np
from sklearn.linear_model import LinearRegression, Ridge
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from opml_common.errors import FailedPrecondition, InvalidArgument
from opml_common.perfmodel.influence import Influence, interaction_features, term_names
from opml_common.perfmodel.learn import tree_learner
from opml_common.perfmodel.space import Sample, encode, log_latency


class SourceModel(Protocol):
    """What a transfer learner needs of the source: its log-latency prediction for target samples
    (a :class:`~.learn.PerformanceModel`, or the source kind's measured profiles)."""

    def log_ms(self, samples: Sequence[Sample]) -> np.ndarray: ...


class TargetModel(ABC):
    """A model of the target environment. :meth:`fit` is called once with the target's few
    measurements, then :meth:`predict_ms` for any configurations."""

    name: str
    min_samples = 2

    def fit(self, target: Sequence[Sample]) -> TargetModel:
        """Raises: InvalidArgument with fewer than :attr:`min_samples` samples or one without latency."""
        if len(target) < self.min_samples:
            raise InvalidArgument("target", f"{self.name} needs at least {self.min_samples} measurements, "
                                            f"but got {len(target)}")
        self._fit(encode(target), log_latency(target), target)
        self._fitted = True
        return self

    def predict_ms(self, samples: Sequence[Sample]) -> np.ndarray:
        """Predicted mean batch latency in ms. Raises: FailedPrecondition before :meth:`fit`."""
        if not getattr(self, "_fitted", False):
            raise FailedPrecondition(f"{self.name} is not fitted yet")
        return np.exp(self._predict(encode(samples), samples))

    @abstractmethod
    def _fit(self, features: np.ndarray, target: np.ndarray, samples: Sequence[Sample]) -> None: ...

    @abstractmethod
    def _predict(self, features: np.ndarray, samples: Sequence[Sample]) -> np.ndarray: ...


class ModelShift(TargetModel):
    """log target = a + b * log source prediction."""

    name = "model-shift"

    def __init__(self, source: SourceModel) -> None:
        self.source = source
        self._line = LinearRegression()

    def _fit(self, features, target, samples):
        self._line.fit(self.source.log_ms(samples).reshape(-1, 1), target)

    def _predict(self, features, samples):
        return self._line.predict(self.source.log_ms(samples).reshape(-1, 1))


class ScaleShift(TargetModel):
    """log target = log source prediction + the median of the samples' log ratios."""

    name = "scale-shift"
    min_samples = 1

    def __init__(self, source: SourceModel) -> None:
        self.source = source
        self._offset = 0.0

    def _fit(self, features, target, samples):
        self._offset = float(np.median(target - self.source.log_ms(samples)))

    def _predict(self, features, samples):
        return self.source.log_ms(samples) + self._offset


class InfluenceTransfer(TargetModel):
    """Ridge on the source's log prediction and the source's influential terms (standardized)."""

    name = "influence-transfer"

    def __init__(self, source: SourceModel, terms: Sequence[Influence], *, alpha: float = 1.0) -> None:
        """Raises: InvalidArgument when a term is not a main effect or pairwise interaction of the options."""
        self.source = source
        self._expand = interaction_features().fit(np.zeros((1, encode([]).shape[1])))
        names = term_names(self._expand)
        unknown = [t.term for t in terms if t.term not in names]
        if unknown:
            raise InvalidArgument("terms", f"must be terms of {', '.join(names)}, but got {', '.join(unknown)}")
        self._columns = [names.index(t.term) for t in terms]
        self._ridge = make_pipeline(StandardScaler(), Ridge(alpha=alpha))

    def _inputs(self, features, samples):
        terms = self._expand.transform(features)[:, self._columns]
        return np.column_stack([self.source.log_ms(samples), terms])

    def _fit(self, features, target, samples):
        # The source's prediction carries most of it: fit its residual, so ridge shrinks towards the source.
        self._ridge.fit(self._inputs(features, samples), target - self.source.log_ms(samples))

    def _predict(self, features, samples):
        return self.source.log_ms(samples) + self._ridge.predict(self._inputs(features, samples))


class FromScratch(TargetModel):
    """The baseline: the target alone, by ``trees`` (the source model's learner) or ``linear``
    (ridge on every main effect and pairwise interaction)."""

    def __init__(self, learner: str = "trees", *, seed: int = 0, alpha: float = 1.0) -> None:
        """Raises: InvalidArgument for a learner other than trees or linear."""
        if learner not in ("trees", "linear"):
            raise InvalidArgument("learner", f"must be trees or linear, but got {learner!r}")
        self.name = f"scratch-{learner}"
        self._model = tree_learner(seed) if learner == "trees" else make_pipeline(
            interaction_features(), StandardScaler(), Ridge(alpha=alpha))

    def _fit(self, features, target, samples):
        self._model.fit(features, target)

    def _predict(self, features, samples):
        return self._model.predict(features)
