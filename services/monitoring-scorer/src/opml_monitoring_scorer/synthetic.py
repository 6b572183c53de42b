"""Streams with known truth, for tests and benches: a primary model, its reference set, and live
windows under covariate, prior or concept shift, whose true accuracy (or MAE) is known.

Binary and multiclass: features x ~ N(mu, I) (4 numeric) plus one categorical feature; the truth is
softmax(W x + b_cat); the primary model is a logistic regression fitted on clean data (so it is
calibrated where the truth is, as CBPE assumes). Regression: y = w.x + noise whose scale grows with
|x1|, so the error depends on the inputs (what the MPP can learn and a constant cannot).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from sklearn.linear_model import LinearRegression, LogisticRegression

from opml_monitoring_scorer.core.reference import Outputs, ReferenceSet, Task

FEATURES = ("x0", "x1", "x2", "x3")
CATEGORIES = ("a", "b", "c")


@dataclass
class Rows:
    features: dict[str, np.ndarray]
    outputs: Outputs
    labels: np.ndarray


class SyntheticWorld:
    """The truth and a primary model fitted to it."""

    def __init__(self, task: Task, *, seed: int = 0, classes: int = 3) -> None:
        self.task = task
        self.rng = np.random.default_rng(seed)
        self.classes = 2 if task is Task.BINARY else classes
        k = 1 if task is Task.REGRESSION else self.classes
        self.weights = self.rng.normal(0, 1.2, size=(len(FEATURES), k))
        self.cat_effect = self.rng.normal(0, 0.5, size=(len(CATEGORIES), k))
        self.flipped = False
        x, cats, y = self._draw(20_000)
        design = self._design(x, cats)
        if task is Task.REGRESSION:
            self.model = LinearRegression().fit(design, y)
        else:
            self.model = LogisticRegression(max_iter=1000).fit(design, y)

    def _design(self, x: np.ndarray, cats: np.ndarray) -> np.ndarray:
        onehot = (cats[:, None] == np.array(CATEGORIES)[None, :]).astype(float)
        return np.hstack([x, onehot])

    def _draw(self, n: int, *, shift: np.ndarray | None = None, prior: float | None = None,
              cat_p: tuple[float, ...] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        x = self.rng.normal(0, 1, size=(n, len(FEATURES)))
        if shift is not None:
            x = x + shift
        cats = self.rng.choice(CATEGORIES, size=n, p=cat_p)
        codes = np.searchsorted(np.array(CATEGORIES), cats)
        logits = x @ self.weights + self.cat_effect[codes]
        if self.flipped:  # concept shift: where x2 > 0 the truth of the first two classes swaps
            region = x[:, 2] > 0
            logits[region] = logits[region][:, ::-1] if logits.shape[1] > 1 else -logits[region]
        if self.task is Task.REGRESSION:
            y = logits[:, 0] + self.rng.normal(0, 1, n) * (0.2 + np.abs(x[:, 1]))
        else:
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            y = (self.rng.random((n, 1)) > np.cumsum(p, axis=1)).sum(axis=1).astype(float)
            if prior is not None:  # prior shift: keep class 0 rows with probability `prior`, resample
                keep = (y != 0) | (self.rng.random(n) < prior)
                x, cats, y = x[keep], cats[keep], y[keep]
        return x, cats, y

    def rows(self, n: int, *, shift: np.ndarray | None = None, prior: float | None = None,
             cat_p: tuple[float, ...] | None = None) -> Rows:
        x, cats, y = self._draw(n, shift=shift, prior=prior, cat_p=cat_p)
        design = self._design(x, cats)
        features = {name: x[:, i] for i, name in enumerate(FEATURES)}
        features["color"] = cats.astype(object)
        if self.task is Task.REGRESSION:
            return Rows(features, Outputs(self.model.predict(design)), y)
        scores = self.model.predict_proba(design)
        return Rows(features, Outputs(np.argmax(scores, axis=1).astype(float),
                                      scores[:, 1:] if self.classes == 2 else scores), y)

    def reference(self, n: int = 3000) -> ReferenceSet:
        rows = self.rows(n)
        return ReferenceSet.build(task=self.task, features=rows.features, predicted=rows.outputs.predicted,
                                  scores=rows.outputs.scores, labels=rows.labels)
