"""Bounded influence, the wrapper a federation of untrusted members aggregates through: no single
update may move the global model far, whatever it claims.

Each round, before the wrapped strategy aggregates:

- each update's change from the round's model is clipped to ``clip_factor`` times the median of
  the round's change norms (norm clipping, as in Sun et al., 2019, "Can you really backdoor
  federated learning?", with the bound taken from the round itself, so it needs no knowledge of
  the model's scale);
- each update's example count is capped at ``weight_factor`` times the median of the round's counts,
  so a member that claims (and declared) ten million examples weighs at most that much.

The median is the lower middle value for an even count, so in a round of two the larger update
cannot set its own bound. With fewer than half of a round's members hostile, the medians are honest
ones, and one member's contribution to a weighted average (FedAvg, FedProx, FedAdam's
pseudo-gradient) is at most its share, ``weight_factor * m / (weight_factor * m + the others'
counts)`` for a median count ``m``, times ``clip_factor`` times the median change. Honest rounds
whose changes and counts lie within those factors of their medians aggregate exactly as without it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np

from opml_fl_coordinator.strategy.base import Failure, FitIns, FitRes, Scalar, Strategy
from opml_fl_coordinator.weights import cast_like, global_norm, subtract
from opml_fl_coordinator_contract.weights import Weights


def lower_median(values: Sequence[float]) -> float:
    """The middle value, the lower of the two middle ones for an even count."""
    return float(np.sort(np.asarray(values, dtype=np.float64))[(len(values) - 1) // 2])


class BoundedInfluence(Strategy):
    """Clip each update's change and cap its example count (see the module's docstring), then
    aggregate with ``strategy``.

    Args:
        strategy: the wrapped strategy.
        clip_factor: an update's change is scaled down to at most this times the round's median
            change norm (>= 1).
        weight_factor: an update's example count is capped at this times the round's median
            count (>= 1).

    Raises:
        ValueError: a factor below 1 or not a number, or ``strategy`` not a Strategy.
    """

    def __init__(self, strategy: Strategy, *, clip_factor: float, weight_factor: float) -> None:
        if not isinstance(strategy, Strategy):
            raise ValueError(f"strategy must be a Strategy, but got {type(strategy).__name__}")
        for name, value in (("clip_factor", clip_factor), ("weight_factor", weight_factor)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= value < float("inf"):
                raise ValueError(f"{name} must be a number >= 1, but got {value!r}")
        self.strategy = strategy
        self.clip_factor = float(clip_factor)
        self.weight_factor = float(weight_factor)
        self._round_weights: Weights | None = None

    def __repr__(self) -> str:
        return (f"BoundedInfluence({self.strategy!r}, clip_factor={self.clip_factor}, "
                f"weight_factor={self.weight_factor})")

    def initialize(self, weights: Weights) -> Weights:
        self._round_weights = weights
        return self.strategy.initialize(weights)

    def configure_fit(self, server_round: int, weights: Weights, clients: Sequence[str]) -> list[FitIns]:
        self._round_weights = weights
        return self.strategy.configure_fit(server_round, weights, clients)

    def bound(self, results: Sequence[FitRes]) -> tuple[list[FitRes], int, int]:
        """``results`` with changes clipped and counts capped; and how many of each were.

        Raises:
            ValueError: weights of other shapes than the round's model.
        """
        if self._round_weights is None:
            raise ValueError("configure_fit (or initialize) must come before aggregate_fit")
        expected = [w.shape for w in self._round_weights]
        for result in results:
            got = [np.shape(w) for w in result.weights]
            if got != expected:
                raise ValueError(f"client {result.client_id!r} sent weights of shapes {got}, the round's are "
                                 f"{expected}")
        deltas = [subtract(r.weights, self._round_weights) for r in results]
        norms = [global_norm(d) for d in deltas]
        clip = self.clip_factor * lower_median(norms)
        cap = max(1, int(self.weight_factor * lower_median([r.num_examples for r in results])))
        bounded, clipped, capped = [], 0, 0
        for result, delta, norm in zip(results, deltas, norms, strict=True):
            if norm > clip:
                clipped += 1
                scale = clip / norm
                moved = [np.asarray(b, np.float64) + scale * d for b, d in zip(self._round_weights, delta, strict=True)]
                result = replace(result, weights=cast_like(moved, result.weights))
            if result.num_examples > cap:
                capped += 1
                result = replace(result, num_examples=cap)
            bounded.append(result)
        return bounded, clipped, capped

    def aggregate_fit(self, server_round: int, results: Sequence[FitRes],
                      failures: Sequence[Failure]) -> tuple[Weights | None, dict[str, Scalar]]:
        if not results:
            return self.strategy.aggregate_fit(server_round, results, failures)
        bounded, clipped, capped = self.bound(results)
        aggregated, metrics = self.strategy.aggregate_fit(server_round, bounded, failures)
        return aggregated, {**metrics, "updates_clipped": clipped, "examples_capped": capped}

    def evaluate(self, server_round: int, weights: Weights) -> tuple[float, dict[str, Scalar]] | None:
        return self.strategy.evaluate(server_round, weights)

    def state(self) -> dict[str, Weights]:
        return self.strategy.state()

    def load_state(self, state: Mapping[str, Weights]) -> None:
        self.strategy.load_state(state)
