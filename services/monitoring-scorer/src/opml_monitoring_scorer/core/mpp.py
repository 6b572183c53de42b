"""The Model Performance Predictor (ParallelM): a secondary model of the primary model's error.

Classification: a gradient-boosted classifier, calibrated (isotonic, 3-fold; fewer folds, or none,
when the model is right or wrong on fewer reference rows than that), learns P(the primary
model is right | features, its class scores, its predicted class) on the reference; a window's
estimated accuracy is the mean of that probability over its rows. Regression: a gradient-boosted
regressor learns the primary model's absolute error, and the window's estimate is the mean: NannyML's
DLE idea. Unlike CBPE, the MPP sees the features, so it can learn where the model is weak.

Labels that arrive later recalibrate it (:meth:`MPP.recalibrate`), so a concept shift (the same
inputs, different truth), which no label-free estimate can see, shows in the estimates once labels
have taught the MPP where the model now errs. A refit is a candidate, not a replacement: refits on
the reference plus the live labelled rows, the live rows weighing from as much as the reference's
rows each to ten times the whole reference, are judged by cross-validation on the live rows against
the reference's own model, which never saw them, and one replaces it only where it is better by
more than the noise (NannyML's practice of judging an estimator on labelled rows it was not fitted
on). A refit with the reference kept at a tenth of the live rows' weight, replacing the estimator
whatever it scored, made the error worse where the labels carried no new information
(bench/monitoring_scorer_recalibration.py); it stays a candidate, as a shift of the concept
everywhere outdates the reference.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from sklearn.calibration import CalibratedClassifierCV
from sklearn.ensemble import HistGradientBoostingClassifier, HistGradientBoostingRegressor
from threadpoolctl import ThreadpoolController

from opml_common.errors import FailedPrecondition
from opml_monitoring_scorer.core.reference import Outputs, ReferenceSet, Task

_CONTROLLER: ThreadpoolController | None = None


def _one_thread():  # noqa: ANN202 - threadpoolctl's context manager
    """OpenMP limited to one thread (the controller, which scans the loaded libraries, made once)."""
    global _CONTROLLER  # noqa: PLW0603 - one per process, made when first needed
    if _CONTROLLER is None:
        _CONTROLLER = ThreadpoolController()
    return _CONTROLLER.limit(limits=1, user_api="openmp")


_BOOSTING = {"max_iter": 60, "max_leaf_nodes": 15, "min_samples_leaf": 30}
"""Small trees, few rounds: a refit from labels takes about a second on a reference of a few thousand
rows (the MPP models P(correct), a smoother target than the primary model's)."""
_FOLDS = 3
"""Folds of the isotonic calibration, when each outcome (right, wrong) has that many rows."""
CV_FOLDS = 3
"""Folds over the live labelled rows that judge each refit by its error on rows it was not fitted on."""
SIGNIFICANCE = 1.0
"""Standard errors (of the mean paired difference over the live rows) by which a refit's out-of-fold
error must beat the reference's model's to replace it: below that, the labels are as likely noise."""


class FeatureMatrix:
    """Rows -> the secondary model's inputs: numeric features as they are (NaN allowed), categories as
    their reference codes (unknown -> NaN), then the primary model's scores and predicted class."""

    def __init__(self, reference: ReferenceSet) -> None:
        self.numeric = sorted(n for n in reference.features if n not in reference.categorical)
        self.codes = {n: {v: float(i) for i, v in enumerate(sorted(set(reference.features[n])))}
                      for n in sorted(reference.categorical)}

    def build(self, features: Mapping[str, np.ndarray], outputs: Outputs) -> np.ndarray:
        rows = len(outputs)
        columns = [features[n] if n in features and len(features[n]) == rows else np.full(rows, np.nan)
                   for n in self.numeric]
        for name, codes in self.codes.items():
            column = features.get(name)
            columns.append(np.full(rows, np.nan) if column is None or len(column) != rows
                           else np.fromiter((codes.get(str(v), np.nan) for v in column), np.float64, rows))
        scores = outputs.class_scores()
        if scores is not None:
            columns.extend(scores.T)
        columns.append(outputs.predicted.astype(np.float64))
        return np.column_stack(columns)


@dataclass(frozen=True)
class RefitJob:
    """What one recalibration needs, copied when it is due (:meth:`MPP.refit_job`), so it runs away from
    the event loop (a worker thread or process) while labels keep joining: the reference's rows and its
    own fitted model, the live labelled rows, and how many labels the MPP had taken (``covers``)."""

    task: Task
    seed: int
    ref_x: np.ndarray
    ref_y: np.ndarray
    reference_model: object
    live_x: np.ndarray
    live_y: np.ndarray
    covers: int


class MPP:
    """The secondary model of one monitored model version.

    Raises:
        FailedPrecondition: (``__init__``) the reference has no labels to learn the error from.
    """

    def __init__(self, reference: ReferenceSet, *, seed: int = 0, max_labels: int = 20_000,
                 min_labels: int = 200) -> None:
        if reference.labels is None:
            raise FailedPrecondition("the MPP learns the model's error from the reference's labels, which it lacks")
        self.task = reference.task
        self.seed = seed
        self.min_labels = min_labels
        self.matrix = FeatureMatrix(reference)
        self._ref_x = self.matrix.build(reference.features, reference.outputs)
        self._ref_y = _target(self.task, reference.outputs, reference.labels)
        self._live_x: deque[np.ndarray] = deque(maxlen=max_labels)
        self._live_y: deque[float] = deque(maxlen=max_labels)
        self._unfitted = 0
        self.labels = 0
        """Live labelled rows taken (:meth:`add_labels`) since the MPP was built."""
        self.covered = 0
        """Of them, how many the last recalibration judged (0: none ran): the model in use is as new as that."""
        self.refits = 0
        """Recalibrations run (each judges the refits on the live labels)."""
        self.recalibrations = 0
        """Recalibrations that changed the estimator in use."""
        self._reference_model = _fit(self.task, self.seed, self._ref_x, self._ref_y, None)
        self._in_use: tuple[object, int] = (self._reference_model, 0)
        """The estimator in use and the live labelled rows it was fitted on (0: the reference's own
        model), replaced together in one assignment."""

    @property
    def fitted_on(self) -> int:
        """The live labelled rows the estimator in use was fitted on (0: the reference's own model)."""
        return self._in_use[1]

    def row_estimates(self, features: Mapping[str, np.ndarray], outputs: Outputs) -> np.ndarray:
        """Per row: P(right) for classifiers, the expected absolute error for regression."""
        return _predict(self.task, self._in_use[0], self.matrix.build(features, outputs))

    def estimate(self, features: Mapping[str, np.ndarray], outputs: Outputs) -> float:
        """The window's estimate: accuracy (classifiers) or mean absolute error (regression)."""
        return self.scored(features, outputs)[0]

    def scored(self, features: Mapping[str, np.ndarray], outputs: Outputs) -> tuple[float, int]:
        """The window's estimate and the live labelled rows the estimator that made it was fitted on
        (0: the reference's own), read together (a recalibration may be put in use meanwhile)."""
        model, fitted_on = self._in_use
        return float(np.mean(_predict(self.task, model, self.matrix.build(features, outputs)))), fitted_on

    def add_labels(self, features: Mapping[str, np.ndarray], outputs: Outputs, labels: np.ndarray) -> None:
        """Live rows whose labels arrived; kept (the newest ``max_labels``) for :meth:`recalibrate`."""
        x = self.matrix.build(features, outputs)
        y = _target(self.task, outputs, np.asarray(labels, dtype=np.float64))
        self._live_x.extend(x)
        self._live_y.extend(y.tolist())
        self._unfitted += len(y)
        self.labels += len(y)

    @property
    def unfitted(self) -> int:
        """Labelled rows taken since the last refit started."""
        return self._unfitted

    @property
    def due(self) -> bool:
        """Enough new labelled rows since the last fit to refit."""
        return self._unfitted >= self.min_labels

    def refit_job(self, *, quiet: bool = False) -> RefitJob | None:
        """The live rows so far, copied for :func:`recalibrated` (None when not :attr:`due`, or, ``quiet``:
        labels have stopped coming, when no new row came at all); the rows that come after count toward
        the next one. Call it where labels are added (the event loop)."""
        if not (self.due or (quiet and self._unfitted > 0)):
            return None
        self._unfitted = 0
        return RefitJob(self.task, self.seed, self._ref_x, self._ref_y, self._reference_model,
                        np.array(self._live_x), np.array(self._live_y), self.labels)

    def refit_failed(self, job: RefitJob) -> None:
        """``job`` did not end in a model: the labels it took since the last refit put in use count
        toward the next one again (with those that came meanwhile), so none is left out."""
        self._unfitted += job.covers - self.covered

    def use(self, job: RefitJob, model: object | None) -> bool:
        """Puts in use what :func:`recalibrated` chose for ``job`` (None: the reference's own model), in
        one assignment, so a window scored meanwhile reads the old model or the new, whole. Returns
        whether the estimator in use changed."""
        previous = self._in_use[0]
        self._in_use = (self._reference_model, 0) if model is None else (model, len(job.live_y))
        self.refits += 1
        self.covered = job.covers
        if self._in_use[0] is previous:
            return False
        self.recalibrations += 1
        return True

    def recalibrate(self) -> bool:
        """:meth:`refit_job`, :func:`recalibrated` and :meth:`use` in one call (the bench and unit tests;
        the scorer runs the refit in the background). Returns whether the estimator in use changed
        (never before ``min_labels`` new rows)."""
        job = self.refit_job()
        return job is not None and self.use(job, recalibrated(job))


def recalibrated(job: RefitJob) -> object | None:
    """Chooses, from the live labelled rows, between the reference's own secondary model (None) and
    refits on the reference plus those rows (each live row weighing as a reference row, the live rows
    together as heavy as the reference, or ten times as heavy): each refit is judged by its out-of-fold
    squared error on the live rows (``CV_FOLDS`` folds; the reference's model never saw them), and
    replaces the reference's only when it beats it by ``SIGNIFICANCE`` standard errors; the winner is
    then refitted on every live row and returned. Pure (a worker process may run it); OpenMP on one thread."""
    with _one_thread():
        return _recalibrated(job)


def _recalibrated(job: RefitJob) -> object | None:
    live_x, live_y = job.live_x, job.live_y
    rows_ref, rows_live = len(job.ref_y), len(live_y)
    # identical rows share a fold: a row repeated in the live stream, fitted in one fold and judged
    # in another, would score a refit on what it memorised
    _, group = np.unique(live_x, axis=0, return_inverse=True)
    group = group.reshape(-1)
    if group.max() + 1 < CV_FOLDS:  # fewer distinct rows than folds: nothing to judge a refit on
        return None
    fold = (np.random.default_rng(job.seed).permutation(group.max() + 1) % CV_FOLDS)[group]
    reference_loss = (_predict(job.task, job.reference_model, live_x) - live_y) ** 2
    best_weight, best_loss = None, float(reference_loss.mean())
    # each live row as a reference row; the live rows together as heavy as the reference; the
    # reference at a tenth of the live rows' weight (a concept shift everywhere outdates it)
    for live_weight in sorted({1.0, max(1.0, rows_ref / rows_live), 10.0 * max(1, rows_ref) / rows_live}):
        out_of_fold = np.empty(rows_live)
        for k in range(CV_FOLDS):
            # uncalibrated in the folds (a third of the cost): judged against the calibrated
            # reference model, a refit must win without its calibration's help
            model = _refit(job, live_x[fold != k], live_y[fold != k], live_weight, calibrate=False)
            out_of_fold[fold == k] = _predict(job.task, model, live_x[fold == k])
        loss = (out_of_fold - live_y) ** 2
        gain = reference_loss - loss
        error = float(np.std(gain, ddof=1)) / np.sqrt(rows_live)
        if gain.mean() > SIGNIFICANCE * error and loss.mean() < best_loss:
            best_weight, best_loss = live_weight, float(loss.mean())
    return None if best_weight is None else _refit(job, live_x, live_y, best_weight)


def _refit(job: RefitJob, live_x: np.ndarray, live_y: np.ndarray, live_weight: float, *,  # noqa: ANN202 - an estimator
           calibrate: bool = True):
    """The secondary model fitted on the reference and these live rows, each weighing ``live_weight``
    reference rows."""
    x = np.vstack([job.ref_x, live_x])
    y = np.concatenate([job.ref_y, live_y])
    weights = np.concatenate([np.ones(len(job.ref_y)), np.full(len(live_y), live_weight)])
    return _fit(job.task, job.seed, x, y, weights, calibrate=calibrate)


def _target(task: Task, outputs: Outputs, labels: np.ndarray) -> np.ndarray:
    if task is Task.REGRESSION:
        return np.abs(outputs.predicted - labels)
    return (outputs.predicted == labels).astype(np.int64)


def _fit(task: Task, seed: int, x: np.ndarray, y: np.ndarray, weights: np.ndarray | None, *,  # noqa: ANN202
         calibrate: bool = True):
    # shuffled: the calibration's folds are contiguous, and reference rows come before live ones
    order = np.random.default_rng(seed).permutation(len(y))
    x, y = x[order], y[order]
    weights = None if weights is None else weights[order]
    if task is Task.REGRESSION:
        model = HistGradientBoostingRegressor(**_BOOSTING, random_state=seed)
        model.fit(x, y, sample_weight=weights)
        return model
    if len(np.unique(y)) < 2:  # always right (or always wrong): nothing to learn but the rate
        return float(y.mean())
    # A model wrong (or right) on fewer rows than the folds, common for a good model's reference,
    # is calibrated on as many folds as the rarer outcome has rows, and not calibrated when it has
    # one; the calibration refuses a fold without both outcomes. Boosting's early stopping (on
    # above 10,000 rows) holds out a stratified split, which needs two rows of each outcome too.
    rarest = int(np.bincount(y).min())
    boosting = HistGradientBoostingClassifier(**_BOOSTING, random_state=seed,
                                              **({} if rarest >= _FOLDS else {"early_stopping": False}))
    model = boosting if rarest < 2 or not calibrate else CalibratedClassifierCV(boosting, method="isotonic",
                                                                                 cv=min(_FOLDS, rarest))
    model.fit(x, y, sample_weight=weights)
    return model


def _predict(task: Task, model, x: np.ndarray) -> np.ndarray:  # noqa: ANN001 - a fitted estimator or a rate
    if isinstance(model, float):
        return np.full(len(x), model)
    # one thread: a window is a few thousand rows, where OpenMP's threads cost more than they
    # save, and on a busy machine they spin (measured: 8x slower on 2 shared cores)
    with _one_thread():
        if task is Task.REGRESSION:
            return np.maximum(model.predict(x), 0.0)
        return model.predict_proba(x)[:, 1]
