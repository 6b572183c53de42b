"""The operator's held-out set: what makes a published global model monitored from its first window.

The coordinator holds no training data (members keep theirs), so a federation may name a bundle of
held-out rows the operator is allowed to hold (``holdout: {context, bundle}``): ``holdout.npz`` with
``x`` ``[rows, features]`` (numbers) and ``y`` ``[rows]`` (class indices). Each published model is
run on it here, in numpy, with the same layers :mod:`onnx_export` writes, and its bundle carries the
result as ``reference.npz`` (the rows, the model's outputs and the truth), so the monitoring-scorer
estimates the model's accuracy without labels and alerts when the estimate falls; its accuracy on
the set is a value of the bundle. The file is bounded before numpy reads it.
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from opml_common.errors import InvalidArgument
from opml_fl_coordinator_contract.weights import Weights
from opml_monitoring_scorer_contract.reference import reference_npz

HOLDOUT_FILE = "holdout.npz"
MAX_HOLDOUT_BYTES = 64 * 1024 * 1024
"""The most ``holdout.npz`` may hold, stored and expanded."""
MAX_HOLDOUT_ROWS = 100_000
INPUT_TENSOR = "input"
"""The exported model's input tensor: the scorer names its columns ``input[0]``, ``input[1]``, ...
(``input`` when it has one)."""


@dataclass(frozen=True)
class Holdout:
    x: np.ndarray  # [rows, features] float32
    y: np.ndarray  # [rows] int64 class indices

    @classmethod
    def parse(cls, data: bytes) -> Holdout:
        """Raises: InvalidArgument: too large, not an npz of ``x`` and ``y``, or shapes that do not fit (all named)."""
        where = f"holdout.{HOLDOUT_FILE}"
        if len(data) > MAX_HOLDOUT_BYTES:
            raise InvalidArgument(where, f"holds {len(data)} bytes, more than {MAX_HOLDOUT_BYTES}")
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                expanded = sum(entry.file_size for entry in archive.infolist())
            if expanded > MAX_HOLDOUT_BYTES:
                raise InvalidArgument(where, f"expands to {expanded} bytes, more than {MAX_HOLDOUT_BYTES}")
            arrays = dict(np.load(io.BytesIO(data), allow_pickle=False))
        except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
            raise InvalidArgument(where, f"is not a numpy .npz of arrays: {exc}") from None
        problems = [(f"{where}.{k}", "is missing") for k in ("x", "y") if k not in arrays]
        if problems:
            raise InvalidArgument.of(problems)
        x, y = arrays["x"], arrays["y"]
        if x.ndim != 2 or not np.issubdtype(x.dtype, np.number):
            problems.append((f"{where}.x", f"must be numbers [rows, features], but is {x.dtype} {x.shape}"))
        if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
            problems.append((f"{where}.y", f"must be class indices [rows], but is {y.dtype} {y.shape}"))
        elif y.size and y.min() < 0:
            problems.append((f"{where}.y", f"holds a negative class index ({int(y.min())})"))
        if not problems and len(x) != len(y):
            problems.append((f"{where}.y", f"has {len(y)} rows, but x has {len(x)}"))
        if not problems and not 0 < len(x) <= MAX_HOLDOUT_ROWS:
            problems.append((f"{where}.x", f"has {len(x)} rows, not 1 to {MAX_HOLDOUT_ROWS}"))
        if problems:
            raise InvalidArgument.of(problems)
        return cls(np.asarray(x, np.float32), np.asarray(y, np.int64))


_ACTIVATIONS = {"relu": lambda v: np.maximum(v, 0.0), "tanh": np.tanh,
                "sigmoid": lambda v: 1.0 / (1.0 + np.exp(-v)), "linear": lambda v: v}


def probabilities(weights: Weights, x: np.ndarray, *, hidden_activation: str) -> np.ndarray:
    """The dense classifier's class probabilities on ``x``: the graph :mod:`onnx_export` writes
    (MatMul + Add per layer, ``hidden_activation`` between, softmax last), in float32 as it runs."""
    layers: Sequence[tuple[np.ndarray, np.ndarray]] = list(zip(weights[0::2], weights[1::2], strict=True))
    current = np.asarray(x, np.float32)
    for index, (kernel, bias) in enumerate(layers):
        current = current @ np.asarray(kernel, np.float32) + np.asarray(bias, np.float32)
        if index < len(layers) - 1:
            current = _ACTIVATIONS[hidden_activation](current)
    shifted = np.exp(current - current.max(axis=1, keepdims=True))
    return (shifted / shifted.sum(axis=1, keepdims=True)).astype(np.float32)


@dataclass(frozen=True)
class HoldoutResult:
    accuracy: float
    reference: bytes  # reference.npz


def evaluate(holdout: Holdout, weights: Weights, *, hidden_activation: str) -> HoldoutResult:
    """The model's accuracy on the held-out rows and the reference set made of them.

    Raises: InvalidArgument: the rows' width is not the model's input width, or a class index is
        beyond the model's classes."""
    features, classes = weights[0].shape[0], weights[-1].shape[0]
    problems = []
    if holdout.x.shape[1] != features:
        problems.append((f"holdout.{HOLDOUT_FILE}.x", f"has {holdout.x.shape[1]} features, but the model takes {features}"))
    if int(holdout.y.max()) >= classes:
        problems.append((f"holdout.{HOLDOUT_FILE}.y", f"names class {int(holdout.y.max())}, but the model has {classes}"))
    if problems:
        raise InvalidArgument.of(problems)
    scores = probabilities(weights, holdout.x, hidden_activation=hidden_activation)
    predicted = scores.argmax(axis=1)
    columns = ({INPUT_TENSOR: holdout.x[:, 0]} if features == 1
               else {f"{INPUT_TENSOR}[{i}]": holdout.x[:, i] for i in range(features)})
    return HoldoutResult(float((predicted == holdout.y).mean()),
                         reference_npz(columns, predicted=predicted, scores=scores, labels=holdout.y))
