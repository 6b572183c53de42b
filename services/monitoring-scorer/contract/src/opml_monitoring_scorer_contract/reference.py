"""The files a model bundle carries so the monitoring-scorer watches it from its first window.

Every producer of a servable bundle (the automl trial SDK, the fl-coordinator, pipelines' evaluate
step, the main job) writes its reference set with :func:`reference_npz` rather than its own copy of
the format, so what they write is what the scorer reads (``reference.npz``: ``feature.<name>``
columns, ``predicted``, optional ``scores`` and ``labels``; numpy only, no pickles) within the
limits it enforces before reading.
"""

from __future__ import annotations

import io
from collections.abc import Mapping

import numpy as np

REFERENCE_FILE = "reference.npz"
MONITORING_FILE = "monitoring.yaml"
MAX_REFERENCE_BYTES = 256 * 1024 * 1024
"""The most ``reference.npz`` may hold, stored and expanded (its arrays as numpy reads them)."""
MAX_REFERENCE_ROWS = 1_000_000


def reference_npz(features: Mapping[str, np.ndarray], *, predicted: np.ndarray, scores: np.ndarray | None = None,
                  labels: np.ndarray | None = None) -> bytes:
    """``reference.npz`` of held-out rows: their ``features`` (one column per name: numbers, or
    strings for categories), the model's ``predicted`` class index or value, a classifier's
    ``scores`` (``[n, classes]`` probabilities, or ``[n, 1]`` = P(class 1)) and the truth ``labels``
    when known (without them the scorer estimates no performance).

    Raises:
        ValueError: no feature, a column that is not one value per row, row counts that differ, more
            than ``MAX_REFERENCE_ROWS`` rows, or more than ``MAX_REFERENCE_BYTES`` in all (each named).
    """
    arrays: dict[str, np.ndarray] = {}
    for name, column in features.items():
        values = np.asarray(column)
        arrays[f"feature.{name}"] = values.astype(str) if values.dtype == object else values
    arrays["predicted"] = np.asarray(predicted)
    if scores is not None:
        arrays["scores"] = np.asarray(scores, dtype=np.float32)
    if labels is not None:
        arrays["labels"] = np.asarray(labels)
    problems = [] if features else ["features: none given (at least one column)"]
    rows = len(arrays["predicted"])
    for key, values in arrays.items():
        if values.ndim == 0:
            problems.append(f"{key}: a scalar, not one value per row")
        elif len(values) != rows:
            problems.append(f"{key}: {len(values)} rows, but predicted has {rows}")
        elif key.startswith("feature.") and values.ndim != 1:
            problems.append(f"{key}: shape {values.shape}, not one value per row")
    if rows > MAX_REFERENCE_ROWS:
        problems.append(f"predicted: {rows} rows, more than {MAX_REFERENCE_ROWS}")
    if problems:
        raise ValueError("reference set: " + "; ".join(problems))
    size = sum(values.nbytes for values in arrays.values())
    if size > MAX_REFERENCE_BYTES:
        raise ValueError(f"reference set: {size} bytes of arrays, more than {MAX_REFERENCE_BYTES}")
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    return buffer.getvalue()
