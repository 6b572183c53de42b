"""The files a model bundle carries so the monitoring-scorer watches it from its first window.

Every producer of a servable bundle (the automl trial SDK, the fl-coordinator, pipelines' evaluate
step, the main job) writes its reference set with :func:`reference_npz` rather than its own copy of
the format, so what they write is what the scorer reads (``reference.npz``: ``feature.<name>``
columns, ``predicted``, optional ``scores``, ``labels`` and ``segment.<parameter>`` columns; numpy
only, no pickles) within the limits it enforces before reading.
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
MAX_SEGMENT_COLUMNS = 8
"""Most ``segment.<parameter>`` columns one reference set carries."""
MAX_SEGMENT_VALUE_CHARS = 64
"""Longest segment value (a longer request parameter is in the scorer's segment ``other``)."""
BAD_ROWS_OVER = 0.05
"""Share of a window's rows with missing, NaN or out-of-range inputs that alerts, above what clean traffic
shows (:func:`bad_input_over`)."""
BAD_ROWS_SIGMAS = 5.0
"""Standard deviations of a clean window's bad share the bad-input bound keeps above its mean."""
MAX_BAD_ROWS_OVER = 0.95
"""A bad-input bound past this could not tell broken inputs from clean ones: no such rule is written."""


def reference_npz(features: Mapping[str, np.ndarray], *, predicted: np.ndarray, scores: np.ndarray | None = None,
                  labels: np.ndarray | None = None, segments: Mapping[str, np.ndarray] | None = None) -> bytes:
    """``reference.npz`` of held-out rows: their ``features`` (one column per name: numbers, or
    strings for categories), the model's ``predicted`` class index or value, a classifier's
    ``scores`` (``[n, classes]`` probabilities, or ``[n, 1]`` = P(class 1)), the truth ``labels``
    when known (without them the scorer estimates no performance), and per request parameter the
    value each row would carry as its request's parameter (``segments``, e.g. ``{"line": ["3", ...]}``,
    written as text ``segment.<parameter>``): a version monitored per segment of that parameter
    (monitoring.yaml ``segment``) judges each segment against its own rows.

    Raises:
        ValueError: no feature, a column that is not one value per row, row counts that differ, more
            than ``MAX_REFERENCE_ROWS`` rows, more than ``MAX_SEGMENT_COLUMNS`` segment columns, a
            segment value over ``MAX_SEGMENT_VALUE_CHARS`` characters, or more than
            ``MAX_REFERENCE_BYTES`` in all (each named).
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
    for parameter, column in (segments or {}).items():
        values = np.asarray(column).astype(str)
        arrays[f"segment.{parameter}"] = values
        if not parameter:
            problems.append("segments: a parameter name is empty")
        if values.ndim == 1 and len(values) and max(len(v) for v in values) > MAX_SEGMENT_VALUE_CHARS:
            problems.append(f"segment.{parameter}: a value longer than {MAX_SEGMENT_VALUE_CHARS} characters")
    if len(segments or {}) > MAX_SEGMENT_COLUMNS:
        problems.append(f"segments: {len(segments or {})} columns, more than {MAX_SEGMENT_COLUMNS}")
    rows = len(arrays["predicted"])
    for key, values in arrays.items():
        if values.ndim == 0:
            problems.append(f"{key}: a scalar, not one value per row")
        elif len(values) != rows:
            problems.append(f"{key}: {len(values)} rows, but predicted has {rows}")
        elif key.startswith(("feature.", "segment.")) and values.ndim != 1:
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


def clean_bad_share(columns: int, reference_rows: int) -> float:
    """The share of clean rows (drawn like the reference's) that the monitoring-scorer's range check
    flags: a new draw of a continuous column falls outside the min..max of ``reference_rows`` draws
    with probability 2 / (n + 1), and a row is flagged when any of its ``columns`` is (fewer for a
    column of repeated values, so this is an upper bound). 256 pixel columns against 1,000 reference
    rows: 40 % of clean rows; a fixed 5 % bound alerted on every clean window of an image model."""
    return 1.0 - (1.0 - 2.0 / (reference_rows + 1)) ** columns


def bad_input_over(columns: int, reference_rows: int, window: int) -> float | None:
    """A ``data_quality`` rule's bound for a model of ``columns`` input columns whose ranges come from
    ``reference_rows`` rows (the reference set's, or the first window's where there is none), judged on
    windows of ``window`` predictions: what clean traffic shows (:func:`clean_bad_share`), plus
    ``BAD_ROWS_SIGMAS`` standard deviations of a window's share, plus ``BAD_ROWS_OVER``; None when that
    passes ``MAX_BAD_ROWS_OVER`` (so many columns against so few rows that the check says nothing).
    Every producer of a monitored bundle writes its bad-input rule with it."""
    clean = clean_bad_share(columns, reference_rows)
    bound = clean + BAD_ROWS_SIGMAS * float(np.sqrt(clean * (1.0 - clean) / window)) + BAD_ROWS_OVER
    return round(bound, 4) if bound <= MAX_BAD_ROWS_OVER else None
