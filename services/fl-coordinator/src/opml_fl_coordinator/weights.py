"""Model weights as the coordinator handles them: a list of numpy arrays, in the model's layer order
(:data:`~opml_fl_coordinator_contract.weights.Weights`, the contract's, as members send them).

Everything here is pure numpy: shapes, norms, the difference between two models, and a
self-describing byte form (``.npz``) for stores and bundles.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np

from opml_fl_coordinator_contract.weights import Weights


def shapes(weights: Sequence[np.ndarray]) -> list[tuple[int, ...]]:
    return [tuple(array.shape) for array in weights]


def subtract(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> Weights:
    return [np.asarray(x, dtype=np.float64) - np.asarray(y, dtype=np.float64) for x, y in zip(a, b, strict=True)]


def add(a: Sequence[np.ndarray], b: Sequence[np.ndarray], scale: float = 1.0) -> Weights:
    return [np.asarray(x, dtype=np.float64) + scale * np.asarray(y, dtype=np.float64)
            for x, y in zip(a, b, strict=True)]


def global_norm(weights: Sequence[np.ndarray]) -> float:
    """L2 norm of all arrays taken as one vector."""
    return float(np.sqrt(sum(float(np.sum(np.square(np.asarray(w, dtype=np.float64)))) for w in weights)))


def cast_like(weights: Sequence[np.ndarray], like: Sequence[np.ndarray]) -> Weights:
    """``weights`` in the dtypes of ``like`` (aggregation computes in float64)."""
    return [np.asarray(w).astype(ref.dtype, copy=False) for w, ref in zip(weights, like, strict=True)]


def to_bytes(weights: Sequence[np.ndarray]) -> bytes:
    """An ``.npz`` of ``w0 .. wN`` (no pickles)."""
    buffer = io.BytesIO()
    np.savez(buffer, **{f"w{i}": np.asarray(w) for i, w in enumerate(weights)})
    return buffer.getvalue()


def from_bytes(data: bytes) -> Weights:
    """Reads what :func:`to_bytes` wrote; refuses pickled object arrays.

    Raises:
        ValueError: not an npz of ``w0 .. wN``.
    """
    with np.load(io.BytesIO(data), allow_pickle=False) as archive:
        names = sorted(archive.files, key=lambda name: int(name[1:]) if name[1:].isdigit() else -1)
        if names != [f"w{i}" for i in range(len(names))]:
            raise ValueError(f"weights archive must hold w0..wN, but holds {names[:5]}")
        return [archive[name] for name in names]
