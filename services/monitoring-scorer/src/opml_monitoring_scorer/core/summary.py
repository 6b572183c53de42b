"""Drift of the predictions that carry only summaries (tensors over the router's record cap).

Such a prediction carries, per tensor, its datatype, shape and four statistics over every element:
mean, std, min and max (the router's ``TensorSummary``; a prediction whose request is recorded but
whose response was summarised has its input statistics computed here from the request the same way).
It has no rows, so its features cannot be compared with the reference column by column; what can be
compared is the statistics themselves. A statistic of a request of N rows depends on N (the min of
100 rows is lower than the min of one), so the reference is summarised the same way: its rows, in
a seeded shuffled order, cut into disjoint groups of N rows, each group's tensor (the reference
columns that tensor was decoded into, ``[N, k]``) summarised into mean, std, min and max over all its
elements. Per tensor and statistic (``summary:<tensor>.<stat>``) the window's per-prediction values
are then compared with the reference groups' values with the drift test the scorer uses for numeric
features (``DriftSuite``'s choice by reference size: here the number of reference groups; methods and
thresholds from the config by that name, or ``*``). A window whose summaries have several batch sizes
is compared with a mixture of the reference groups of those sizes, in the window's proportions.

A batch size with fewer than ``MIN_GROUPS`` reference groups (a request of more than a tenth of the
reference's rows) is not compared: the window is flagged ``summary_unscored:<tensor>``.

Which reference columns make a tensor follows the decode (decode.py): the config's names for it,
else the column named like the tensor (``[batch]`` or ``[batch, 1]``), else ``tensor[0]``,
``tensor[1]``..., else a wide tensor's per-row ``tensor.mean/.std/.min/.max`` (from which the
statistics of N rows are exact: the mean of the row means, the pooled std, the min of the mins, the
max of the maxes). Categorical (BYTES) tensors have no statistics and are not compared.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from opml.inference.v1 import events_pb2
from tritonclient.grpc import service_pb2 as pb

from opml_common.kserve_codec import decode_request
from opml_monitoring_scorer.core.drift import ColumnDrift, FeatureDrift
from opml_monitoring_scorer.core.reference import is_categorical

STATS = ("mean", "std", "min", "max")
MIN_GROUPS = 10
"""Fewest reference groups of a batch size for its summaries to be compared."""
PREFIX = "summary:"
_INDEXED = re.compile(r"^(.+)\[(\d+)\]$")


@dataclass(frozen=True)
class TensorStats:
    """One tensor of one summary-only prediction: its rows (the batch dimension) and its statistics."""

    rows: int
    mean: float
    std: float
    min: float
    max: float

    def value(self, stat: str) -> float:
        return float(getattr(self, stat))


@dataclass(frozen=True)
class PredictionSummary:
    """What a summary-only prediction carries of its inputs: per tensor its statistics, or None where
    the tensor has none (BYTES, or contents that did not match the datatype)."""

    rows: int
    tensors: dict[str, TensorStats | None] = field(default_factory=dict)


def summary_of(event: events_pb2.PredictionMade) -> PredictionSummary:
    """The input statistics a summary-only prediction carries (its ``input_summaries``, or, when its
    request was recorded and only its response summarised, those of the recorded request)."""
    tensors: dict[str, TensorStats | None] = {}
    sizes = [1]
    if event.infer_request:
        try:
            arrays = decode_request(pb.ModelInferRequest.FromString(event.infer_request))
        except Exception:  # noqa: BLE001 - an undecodable request carries nothing to compare
            arrays = {}
        for name, array in arrays.items():
            rows = int(array.shape[0]) if array.ndim else 1
            sizes.append(rows)
            if array.dtype.kind in "biuf" and array.size:
                values = array.astype(np.float64)
                tensors[name] = TensorStats(rows, float(values.mean()), float(values.std()),
                                            float(values.min()), float(values.max()))
            else:
                tensors[name] = None
    else:
        for summary in event.input_summaries:
            rows = int(summary.shape[0]) if summary.shape else 1
            sizes.append(rows)
            tensors[summary.name] = (TensorStats(rows, summary.mean, summary.std, summary.min, summary.max)
                                     if summary.has_stats else None)
    return PredictionSummary(rows=max(sizes), tensors=tensors)


class _TensorReference:
    """A tensor's reference values: a matrix ``[R, k]`` of its columns, or a wide tensor's per-row stats."""

    def __init__(self, matrix: np.ndarray | None = None, row_stats: Mapping[str, np.ndarray] | None = None) -> None:
        self.matrix = matrix
        self.row_stats = row_stats
        if matrix is not None:
            self.rows = len(matrix)
            self.range = (float(np.nanmin(matrix)), float(np.nanmax(matrix)))
        else:
            assert row_stats is not None
            self.rows = len(row_stats["mean"])
            self.range = (float(np.nanmin(row_stats["min"])), float(np.nanmax(row_stats["max"])))

    def grouped(self, order: np.ndarray, n: int) -> dict[str, np.ndarray]:
        """The statistics of disjoint groups of ``n`` reference rows (rows taken in ``order``)."""
        groups = self.rows // n
        take = order[:groups * n]
        if self.matrix is not None:
            values = self.matrix[take].reshape(groups, -1)
            return {"mean": values.mean(axis=1), "std": values.std(axis=1),
                    "min": values.min(axis=1), "max": values.max(axis=1)}
        s = {k: v[take].reshape(groups, n) for k, v in self.row_stats.items()}
        mean = s["mean"].mean(axis=1)
        second = (s["std"] ** 2 + s["mean"] ** 2).mean(axis=1)
        return {"mean": mean, "std": np.sqrt(np.maximum(second - mean ** 2, 0.0)),
                "min": s["min"].min(axis=1), "max": s["max"].max(axis=1)}


def reference_tensors(features: Mapping[str, np.ndarray],
                      feature_names: Mapping[str, Sequence[str]]) -> dict[str, _TensorReference]:
    """The numeric input tensors the reference's columns were decoded from (see the module doc)."""
    numeric = {n: c for n, c in features.items() if not is_categorical(c)}
    tensors: dict[str, _TensorReference] = {}
    used: set[str] = set()
    for tensor, names in feature_names.items():
        if all(n in numeric for n in names):
            tensors[tensor] = _TensorReference(np.column_stack([numeric[n] for n in names]))
            used.update(names)
    indexed: dict[str, dict[int, str]] = {}
    wide: set[str] = set()
    for name in numeric:
        if name in used:
            continue
        match = _INDEXED.match(name)
        if match:
            indexed.setdefault(match.group(1), {})[int(match.group(2))] = name
        elif "." in name and name.rsplit(".", 1)[1] in STATS:
            base = name.rsplit(".", 1)[0]
            if all(f"{base}.{s}" in numeric for s in STATS):
                wide.add(base)
    for tensor, columns in indexed.items():
        if tensor not in tensors and sorted(columns) == list(range(len(columns))):
            tensors[tensor] = _TensorReference(np.column_stack([numeric[columns[i]] for i in range(len(columns))]))
            used.update(columns.values())
    for tensor in wide:
        if tensor not in tensors:
            tensors[tensor] = _TensorReference(row_stats={s: numeric[f"{tensor}.{s}"] for s in STATS})
            used.update(f"{tensor}.{s}" for s in STATS)
    for name, column in numeric.items():
        if name not in used and name not in tensors:
            tensors[name] = _TensorReference(column[:, None])
    return tensors


class SummaryDrift:
    """Per input tensor of the reference, its statistics in groups of each batch size seen (computed
    once per size); :meth:`measure` compares a window's summary-only predictions with them."""

    def __init__(self, features: Mapping[str, np.ndarray], feature_names: Mapping[str, Sequence[str]], *,
                 methods: Mapping[str, str] | None = None, thresholds: Mapping[str, float] | None = None,
                 seed: int = 0) -> None:
        self.tensors = reference_tensors(features, feature_names)
        self.methods, self.thresholds = dict(methods or {}), dict(thresholds or {})
        self._rng = np.random.default_rng(seed)
        self._order = {name: self._rng.permutation(ref.rows) for name, ref in self.tensors.items()}
        self._grouped: dict[tuple[str, int], dict[str, np.ndarray]] = {}

    @property
    def ranges(self) -> dict[str, tuple[float, float]]:
        """Per reference tensor, the range of its values (data quality of summaries)."""
        return {name: ref.range for name, ref in self.tensors.items()}

    def reference_stats(self, tensor: str, n: int) -> dict[str, np.ndarray] | None:
        """The statistics of the reference's groups of ``n`` rows (a seeded shuffle, disjoint groups), or
        None when there are fewer than ``MIN_GROUPS`` of them."""
        ref = self.tensors[tensor]
        if n < 1 or ref.rows // n < MIN_GROUPS:
            return None
        key = (tensor, n)
        if key not in self._grouped:
            self._grouped[key] = ref.grouped(self._order[tensor], n)
        return self._grouped[key]

    def measure(self, summaries: Sequence[PredictionSummary]) -> tuple[dict[str, FeatureDrift], list[str]]:
        """Drift per ``summary:<tensor>.<stat>``, and the tensors not compared (batch sizes too large
        for the reference)."""
        out: dict[str, FeatureDrift] = {}
        unscored: list[str] = []
        for tensor in self.tensors:
            seen = [s.tensors[tensor] for s in summaries if s.tensors.get(tensor) is not None]
            if not seen:
                continue
            by_size: dict[int, list[TensorStats]] = {}
            for stats in seen:
                by_size.setdefault(stats.rows, []).append(stats)
            grouped = {n: self.reference_stats(tensor, n) for n in by_size}
            if any(g is None for g in grouped.values()):
                unscored.append(tensor)
                continue
            # the mixture of the sizes' reference groups in the window's proportions: the largest
            # total each size can fill
            total = len(seen)
            size = min(len(g["mean"]) * total // len(by_size[n]) for n, g in grouped.items())
            for stat in STATS:
                window = np.array([s.value(stat) for s in seen])
                reference = np.concatenate([g[stat][:max(1, len(by_size[n]) * size // total)]
                                            for n, g in grouped.items()])
                name = f"{PREFIX}{tensor}.{stat}"
                drift = ColumnDrift(name, reference, method=self.methods.get(name, self.methods.get("*", "auto")),
                                    threshold=self.thresholds.get(name, self.thresholds.get("*")),
                                    categorical=False).measure(window)
                if drift is not None:
                    out[name] = drift
        return out, unscored
