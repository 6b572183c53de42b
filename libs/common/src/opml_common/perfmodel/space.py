"""The serving configuration space a performance model learns over, and its encoding as features.

Kept apart from the learners so the router (which measures and predicts) and the automl-controller
(which may use predictions as a cheap objective) name options the same way.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from opml_common.errors import InvalidArgument

OPT_LEVELS = ("disable", "basic", "extended", "all")
"""ONNX Runtime's graph optimization levels, in increasing order."""
EXECUTION_MODES = ("sequential", "parallel")
PRECISIONS = ("fp32", "int8")
OPTIONS = ("batch", "threads", "opt_level", "parallel", "int8", "model_size")
"""Feature names, in column order: log2 batch, intra-op threads, optimization level index, parallel
execution (0/1), int8 (0/1), log10 of the model's MFLOP per row (so one model covers several models)."""


@dataclass(frozen=True)
class ServingConfig:
    """One way to serve a model on a replica.

    Raises (on construction):
        InvalidArgument: a batch or thread count below 1, or a level, mode or precision not known.
    """

    batch: int
    threads: int = 1
    opt_level: str = "all"
    execution_mode: str = "sequential"
    precision: str = "fp32"

    def __post_init__(self) -> None:
        for name in ("batch", "threads"):
            if getattr(self, name) < 1:
                raise InvalidArgument(name, f"must be >= 1, but got {getattr(self, name)}")
        for name, allowed in (("opt_level", OPT_LEVELS), ("execution_mode", EXECUTION_MODES),
                              ("precision", PRECISIONS)):
            if getattr(self, name) not in allowed:
                raise InvalidArgument(name, f"must be one of {', '.join(allowed)}, but got {getattr(self, name)!r}")


@dataclass(frozen=True)
class Sample:
    """One measured (or to-be-predicted) point: a model of ``mflop_per_row`` work served with ``config``;
    ``latency_ms`` is the mean time of one batch (None when it is to be predicted)."""

    model: str
    mflop_per_row: float
    config: ServingConfig
    latency_ms: float | None = None

    @property
    def throughput_rps(self) -> float:
        """Rows per second one replica serves at this batch (needs ``latency_ms``)."""
        if self.latency_ms is None:
            raise InvalidArgument("latency_ms", f"{self.model} {self.config} has no measured latency")
        return self.config.batch * 1000.0 / self.latency_ms


def grid(*, batches: Sequence[int], threads: Sequence[int], precisions: Sequence[str] = PRECISIONS,
         opt_levels: Sequence[str] = OPT_LEVELS, modes: Sequence[str] = EXECUTION_MODES) -> Iterator[ServingConfig]:
    """Every combination of the given option values."""
    for batch, thread, level, mode, precision in itertools.product(batches, threads, opt_levels, modes, precisions):
        yield ServingConfig(batch, thread, level, mode, precision)


def encode(samples: Iterable[Sample]) -> np.ndarray:
    """The feature matrix of ``samples`` (columns as :data:`OPTIONS`)."""
    rows = [[math.log2(s.config.batch), s.config.threads, OPT_LEVELS.index(s.config.opt_level),
             float(s.config.execution_mode == "parallel"), float(s.config.precision == "int8"),
             math.log10(max(s.mflop_per_row, 1e-6))] for s in samples]
    return np.asarray(rows, dtype=float).reshape(-1, len(OPTIONS))


def log_latency(samples: Iterable[Sample]) -> np.ndarray:
    """The learning target: log latency (latency effects multiply, so errors are relative).

    Raises:
        InvalidArgument: a sample has no positive latency.
    """
    values = []
    for s in samples:
        if s.latency_ms is None or not s.latency_ms > 0:
            raise InvalidArgument("latency_ms", f"{s.model} {s.config} needs a positive latency, but got {s.latency_ms}")
        values.append(math.log(s.latency_ms))
    return np.asarray(values, dtype=float)
