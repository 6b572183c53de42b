"""Estimated accuracy per window with and without the MPP's recalibration from live labels, on drifted
streams of real data sets, in the same run.

Each stream: a model (logistic regression) trained on part of a data set, a reference set (held-out
rows with the model's outputs and labels), then windows of live rows drawn from the rest with a growing
covariate shift (rows resampled along the data's first principal component), alone or with a concept
shift (a region of the inputs, a growing share of it relabelled). The labels of half the rows of the
first two windows arrive, request by request, and recalibrate the MPP the way the scorer does (each
time ``min_labels`` new ones are in); both MPPs then estimate the later windows.

Data sets: scikit-learn's breast cancer (569 rows) and digits (1,797 rows), which ship with it, and
make_classification (binary, 20 features, 5 % label noise).

    .venv/bin/python bench/monitoring_scorer_recalibration.py                   # 3 seeds
    .venv/bin/python bench/monitoring_scorer_recalibration.py --seeds 0 --window 500   # reduced

Prints per stream the mean absolute error of the estimated accuracy over the later windows (mean over
seeds) without and with recalibration, their ratio (below 1: the labels helped), in how many seeds
the labels made it worse, and how many recalibrations changed the MPP in use of how many were run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
from sklearn.datasets import load_breast_cancer, load_digits, make_classification
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "services" / "monitoring-scorer" / "src"))

from opml_monitoring_scorer.core.mpp import MPP  # noqa: E402
from opml_monitoring_scorer.core.reference import Outputs, ReferenceSet, Task, performance  # noqa: E402

LABELLED_WINDOWS = 2
LABELLED_SHARE = 0.5
REQUEST_ROWS = 20
"""Rows per labelled request: labels reach the MPP in batches of this size, as joins do."""


def dataset(name: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    if name == "breast cancer":
        return load_breast_cancer(return_X_y=True)
    if name == "digits":
        x, y = load_digits(return_X_y=True)
        return x / 16.0, y
    return make_classification(n_samples=8000, n_features=20, n_informative=8, n_redundant=4, flip_y=0.05,
                               class_sep=0.8, random_state=seed)


class Rows(NamedTuple):
    features: dict[str, np.ndarray]
    predicted: np.ndarray
    scores: np.ndarray
    labels: np.ndarray


class Stream:
    """A reference set and windows (features, outputs, labels) of one data set under one shift."""

    def __init__(self, name: str, shift: str, seed: int, *, windows: int, size: int) -> None:
        rng = np.random.default_rng(seed)
        x, y = dataset(name, seed)
        order = rng.permutation(len(y))
        x, y = StandardScaler().fit_transform(x[order]), y[order].astype(np.float64)
        quarter = len(y) // 4  # the model's training rows, the reference, the labelled windows' pool, the rest's
        train, ref = np.arange(quarter), np.arange(quarter, 2 * quarter)
        pools = np.arange(2 * quarter, 3 * quarter), np.arange(3 * quarter, len(y))
        self.model = LogisticRegression(max_iter=3000, C=0.05).fit(x[train], y[train])
        self.name, self.shift = name, shift
        self.task = Task.BINARY if len(np.unique(y)) == 2 else Task.MULTICLASS
        self.classes = len(np.unique(y))
        direction = np.linalg.svd(x - x.mean(axis=0), full_matrices=False)[2][0]
        along = x @ direction
        along = (along - along.mean()) / along.std()
        # concept shift: inputs on one side of a second direction get another class
        region = x @ np.linalg.svd(x - x.mean(axis=0), full_matrices=False)[2][1] > 0
        self.x, self.y, self.along, self.region = x, y, along, region
        self.reference = ReferenceSet.build(task=self.task, **self._rows(ref, rng, 0.0)._asdict(), min_rows=100)
        self.windows = []
        for w in range(windows):
            step = w / max(windows - 1, 1)
            pool = pools[w >= LABELLED_WINDOWS]  # rows labelled live are never rows estimated later
            weights = np.exp(1.5 * step * along[pool])
            chosen = rng.choice(pool, size=size, p=weights / weights.sum())
            self.windows.append(self._rows(chosen, rng, 0.6 * (0.3 + 0.7 * step) if shift == "concept" else 0.0))

    def _rows(self, index: np.ndarray, rng: np.random.Generator, relabelled: float) -> Rows:
        probabilities = self.model.predict_proba(self.x[index])
        labels = self.y[index].copy()
        flip = self.region[index] & (rng.random(len(index)) < relabelled)
        labels[flip] = (labels[flip] + 1) % self.classes
        features = {f"f{i}": self.x[index, i] for i in range(self.x.shape[1])}
        scores = probabilities[:, 1:] if self.classes == 2 else probabilities
        return Rows(features, np.argmax(probabilities, axis=1).astype(np.float64), scores, labels)


def teach(mpp: MPP, stream: Stream, seed: int) -> None:
    """Labels of a share of the first windows' rows, request by request, recalibrating when due."""
    rng = np.random.default_rng(seed + 1000)
    for rows in stream.windows[:LABELLED_WINDOWS]:
        labelled = np.flatnonzero(rng.random(len(rows.labels)) < LABELLED_SHARE)
        for start in range(0, len(labelled), REQUEST_ROWS):
            part = labelled[start:start + REQUEST_ROWS]
            mpp.add_labels({k: v[part] for k, v in rows.features.items()},
                           Outputs(rows.predicted[part], rows.scores[part]), rows.labels[part])
            if mpp.due:
                mpp.recalibrate()


def errors(stream: Stream, seed: int) -> tuple[float, float, int, int, float]:
    """MAE over the later windows without and with recalibration, recalibrations run and those that
    changed the MPP, seconds spent recalibrating."""
    plain, taught = MPP(stream.reference, seed=seed), MPP(stream.reference, seed=seed)
    started = time.perf_counter()
    teach(taught, stream, seed)
    spent = time.perf_counter() - started
    before, after = [], []
    for rows in stream.windows[LABELLED_WINDOWS:]:
        truth = performance(stream.task, rows.predicted, rows.labels)
        outputs = Outputs(rows.predicted, rows.scores)
        before.append(abs(plain.estimate(rows.features, outputs) - truth))
        after.append(abs(taught.estimate(rows.features, outputs) - truth))
    return float(np.mean(before)), float(np.mean(after)), taught.refits, taught.recalibrations, spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--window", type=int, default=1000)
    parser.add_argument("--datasets", default="breast cancer,digits,make_classification")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"MAE of the MPP's estimated accuracy over windows {LABELLED_WINDOWS + 1}..{args.windows} "
          f"(windows of {args.window}; labels of {LABELLED_SHARE:.0%} of windows 1..{LABELLED_WINDOWS}); "
          f"mean over seeds {seeds}")
    print(f"{'stream':<36} {'without':>9} {'with':>9} {'with/without':>13} {'worse in':>9} {'changed':>8}")
    ratios = []
    for name in args.datasets.split(","):
        for shift in ("covariate", "concept"):
            rows = [errors(Stream(name, shift, seed, windows=args.windows, size=args.window), seed) for seed in seeds]
            before, after = np.mean([r[0] for r in rows]), np.mean([r[1] for r in rows])
            worse = sum(r[1] > r[0] for r in rows)
            ratios.append(after / before)
            print(f"{name + ' ' + shift + ' shift':<36} {before:>9.4f} {after:>9.4f} {after / before:>13.2f} "
                  f"{worse:>5}/{len(rows)} {sum(r[3] for r in rows):>3}/{sum(r[2] for r in rows):<3}", flush=True)
    print(f"\ngeometric mean of with/without over the streams: {np.exp(np.mean(np.log(ratios))):.2f}")


if __name__ == "__main__":
    main()
