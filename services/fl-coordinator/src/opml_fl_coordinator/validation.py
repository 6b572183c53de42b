"""Screening of client updates' weights before aggregation: wrong shapes or dtypes, NaN/inf, or a
change far larger than others' are refused with the reason, and the update is left out of the round
(the client's profile counts the rejection). An update in another floating dtype than the model's
is taken in the model's (one float16 update must not make the model float16), and must be finite
there. The example count an update claims is the federation's to bound, against what the client
declared when it joined (``Federation.examples_problem``)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from opml_fl_coordinator.weights import cast_like, global_norm, subtract
from opml_fl_coordinator_contract.weights import Weights


class UpdateValidator:
    """Checks one update against the model it started from, and its size against recent ones.

    Args (keyword-only):
        max_update_norm: refuse a change (L2 norm of the difference) above this (None: no bound).
        norm_outlier_factor: refuse a change above this many times the median of the last
            ``history`` accepted changes (once at least three are known).

    Raises:
        ValueError: a bound out of range.
    """

    def __init__(self, *, max_update_norm: float | None = None, norm_outlier_factor: float = 5.0,
                 history: int = 50) -> None:
        if max_update_norm is not None and not max_update_norm > 0:
            raise ValueError(f"max_update_norm must be > 0 or None, but got {max_update_norm!r}")
        if not norm_outlier_factor > 1:
            raise ValueError(f"norm_outlier_factor must be > 1, but got {norm_outlier_factor!r}")
        if history < 3:
            raise ValueError(f"history must be >= 3, but got {history!r}")
        self.max_update_norm = max_update_norm
        self.norm_outlier_factor = norm_outlier_factor
        self.norms: deque[float] = deque(maxlen=history)

    def check(self, weights: Sequence[np.ndarray], base: Weights) -> tuple[float, str | None]:
        """The update's change norm and, when it must be refused, why (None: acceptable so far)."""
        expected = [(tuple(w.shape), w.dtype) for w in base]
        got = [(tuple(np.shape(w)), np.asarray(w).dtype) for w in weights]
        if len(got) != len(expected) or any(g[0] != e[0] for g, e in zip(got, expected)):
            return 0.0, f"weights have shapes {[g[0] for g in got]}, the model's are {[e[0] for e in expected]}"
        if any(not np.issubdtype(g[1], np.floating) for g in got):
            return 0.0, f"weights must be floating point, but got dtypes {sorted({str(g[1]) for g in got})}"
        with np.errstate(over="ignore"):  # a value past the model's dtype becomes inf, refused below
            taken = cast_like(weights, base)
        for index, (array, (_, dtype), (_, model)) in enumerate(zip(taken, got, expected, strict=True)):
            if not np.all(np.isfinite(array)):
                bad = int(np.size(array) - np.count_nonzero(np.isfinite(array)))
                where = "" if dtype == model else f" as {model}, the model's dtype"
                return 0.0, f"array {index} holds {bad} NaN or infinite values{where}"
        norm = global_norm(subtract(taken, base))
        if self.max_update_norm is not None and norm > self.max_update_norm:
            return norm, f"update norm {norm:.4g} exceeds max_update_norm {self.max_update_norm:g}"
        return norm, None

    def outliers(self, norms: dict[str, float]) -> dict[str, str]:
        """Of this batch's change norms, those far above the median of recent and batch ones, with
        the reason; the others join the history."""
        reference = [*self.norms, *norms.values()]
        refused: dict[str, str] = {}
        if len(reference) >= 3:
            median = float(np.median(reference))
            for client_id, norm in norms.items():
                if median > 0 and norm > self.norm_outlier_factor * median:
                    refused[client_id] = (f"update norm {norm:.4g} is more than {self.norm_outlier_factor:g}x the "
                                          f"median of recent updates ({median:.4g})")
        self.norms.extend(n for c, n in norms.items() if c not in refused)
        return refused
