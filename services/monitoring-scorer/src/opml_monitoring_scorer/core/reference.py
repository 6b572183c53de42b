"""The reference set a model is monitored against: features, the model's outputs and the true labels.

Everything the estimators learn (drift baselines, value ranges, categories, the confidence calibration,
the MPP secondary model) comes from here, so a model's monitoring is exactly as good as its reference:
it should be a held-out sample the model was validated on, a few thousand rows or more (Evidently's
tests switch from statistical tests to distances above 1,000 rows; the estimates' spread shrinks
as 1/sqrt(rows)).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from opml_common.errors import InvalidArgument, brief
from opml_monitoring_scorer_contract.reference import MAX_SEGMENT_COLUMNS, MAX_SEGMENT_VALUE_CHARS


class Task(enum.Enum):
    BINARY = "binary"
    MULTICLASS = "multiclass"
    REGRESSION = "regression"


def is_categorical(values: np.ndarray) -> bool:
    """A column is categorical when its values are not numbers (strings, bytes, booleans)."""
    return values.dtype.kind in "OSUb"


def as_column(values: np.ndarray) -> np.ndarray:
    """A feature column as float64 (numeric) or str objects (categorical), so both sides compare."""
    values = np.asarray(values)
    if is_categorical(values):
        out = np.empty(len(values), dtype=object)
        out[:] = [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in values]
        return out
    return values.astype(np.float64, copy=False)


@dataclass
class Outputs:
    """What the model said for a batch of rows: ``predicted`` (class index or value, shape [n]) and,
    for classifiers, ``scores`` (probabilities [n, classes]; binary may be [n, 1] = P(class 1))."""

    predicted: np.ndarray
    scores: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.predicted)

    @property
    def classes(self) -> int | None:
        """How many classes :meth:`class_scores` holds, from the shape alone (nothing is copied)."""
        if self.scores is None:
            return None
        shape = np.shape(self.scores)
        return 2 if len(shape) == 1 or shape[1] == 1 else shape[1]

    def class_scores(self) -> np.ndarray | None:
        """Scores as [n, classes] (a binary model's single column becomes [1 - p, p])."""
        if self.scores is None:
            return None
        scores = np.asarray(self.scores, dtype=np.float64)
        if scores.ndim == 1:
            scores = scores[:, None]
        if scores.shape[1] == 1:
            scores = np.hstack([1.0 - scores, scores])
        return scores

    def confidence(self) -> np.ndarray | None:
        """The score of the predicted class per row (None without scores)."""
        scores = self.class_scores()
        if scores is None:
            return None
        index = np.clip(self.predicted.astype(np.int64), 0, scores.shape[1] - 1)
        return scores[np.arange(len(index)), index]


@dataclass
class ReferenceSet:
    """Features by name (each a column of n rows), the model's outputs on them, and the labels."""

    task: Task
    features: dict[str, np.ndarray]
    outputs: Outputs
    labels: np.ndarray | None = None
    categorical: frozenset[str] = field(default_factory=frozenset)
    segments: dict[str, np.ndarray] = field(default_factory=dict)
    """Per request parameter, each row's value as text (``segment.<parameter>`` of reference.npz)."""

    @classmethod
    def build(cls, *, task: Task, features: Mapping[str, np.ndarray], predicted: np.ndarray,
              scores: np.ndarray | None = None, labels: np.ndarray | None = None,
              segments: Mapping[str, np.ndarray] | None = None, min_rows: int = 100) -> ReferenceSet:
        """Checks the columns and converts them (numeric -> float64, anything else -> str; a segment
        column's values -> str).

        Raises:
            InvalidArgument: every wrong part at once: columns of different lengths, fewer than
                ``min_rows`` rows, no features, classifier without scores, regression with scores,
                outputs, scores or labels that are not numbers (class names: it takes class indexes),
                a segment column that is not one text or integer value per row, or more than
                ``MAX_SEGMENT_COLUMNS`` of them.
        """
        problems: list[tuple[str, str]] = []
        rows = len(predicted)
        if not features:
            problems.append(("reference.features", "must name at least one feature"))
        for name, column in features.items():
            if len(column) != rows:
                problems.append((f"reference.features[{name}]", f"has {len(column)} rows, but the outputs have {rows}"))
        if rows < min_rows:
            problems.append(("reference.outputs", f"must hold at least {min_rows} rows, but holds {rows}"))
        if labels is not None and len(labels) != rows:
            problems.append(("reference.labels", f"has {len(labels)} rows, but the outputs have {rows}"))
        if task is not Task.REGRESSION and scores is None:
            problems.append(("reference.scores", f"a {task.value} model's reference needs its class scores"))
        if scores is not None and len(scores) != rows:
            problems.append(("reference.scores", f"has {len(scores)} rows, but the outputs have {rows}"))
        numbers = {}
        for name, column in (("predicted", predicted), ("scores", scores), ("labels", labels)):
            if column is None:
                continue
            try:
                numbers[name] = np.asarray(column, dtype=np.float64)
            except (TypeError, ValueError):
                what = "class indexes (0, 1, ...), not class names," if task is not Task.REGRESSION else "numbers"
                problems.append((f"reference.{name}", f"must hold {what} but holds {brief(str(column[:3]))}..."))
        problems.extend(_segment_problems(segments or {}, rows))
        if problems:
            raise InvalidArgument.of(problems)
        columns = {name: as_column(column) for name, column in features.items()}
        return cls(task=task, features=columns, outputs=Outputs(numbers["predicted"], numbers.get("scores")),
                   labels=numbers.get("labels"),
                   categorical=frozenset(n for n, c in columns.items() if is_categorical(c)),
                   segments={p: as_column(np.asarray(c).astype(str)) for p, c in (segments or {}).items()})

    def segment(self, parameter: str, value: str) -> ReferenceSet | None:
        """The rows whose ``parameter`` is ``value`` (a segment's own reference; the segment columns are
        dropped); None when the reference has no column of that parameter."""
        column = self.segments.get(parameter)
        if column is None:
            return None
        keep = column == value
        scores = None if self.outputs.scores is None else self.outputs.scores[keep]
        return ReferenceSet(task=self.task, features={n: c[keep] for n, c in self.features.items()},
                            outputs=Outputs(self.outputs.predicted[keep], scores),
                            labels=None if self.labels is None else self.labels[keep], categorical=self.categorical)

    def __len__(self) -> int:
        return len(self.outputs)

    @property
    def has_labels(self) -> bool:
        return self.labels is not None

    def performance(self) -> float | None:
        """The model's metric on the reference: accuracy, or mean absolute error for regression."""
        if self.labels is None:
            return None
        return performance(self.task, self.outputs.predicted, self.labels)


def _segment_problems(segments: Mapping[str, np.ndarray], rows: int) -> list[tuple[str, str]]:
    problems = []
    if len(segments) > MAX_SEGMENT_COLUMNS:
        problems.append(("reference.segments", f"holds {len(segments)} columns, more than {MAX_SEGMENT_COLUMNS}"))
    for parameter, column in segments.items():
        values = np.asarray(column)
        at = f"reference.segment.{parameter}"
        if not parameter:
            problems.append(("reference.segments", "names a column with no parameter (segment.)"))
        elif values.ndim != 1 or values.dtype.kind not in "USiu":
            problems.append((at, f"must hold one text or integer value per row, but holds {values.dtype} "
                                 f"of shape {values.shape}"))
        elif len(values) != rows:
            problems.append((at, f"has {len(values)} rows, but the outputs have {rows}"))
        elif values.dtype.kind in "US" and len(values) and int(np.char.str_len(values).max()) > MAX_SEGMENT_VALUE_CHARS:
            problems.append((at, f"holds a value longer than {MAX_SEGMENT_VALUE_CHARS} characters"))
    return problems


def performance(task: Task, predicted: np.ndarray, labels: np.ndarray) -> float:
    """Accuracy for classifiers, mean absolute error for regression (the metrics the scorer estimates)."""
    if task is Task.REGRESSION:
        return float(np.mean(np.abs(predicted - labels)))
    return float(np.mean(predicted == labels))
