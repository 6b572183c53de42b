"""Central differential privacy as a wrapper (Flower's ``DifferentialPrivacyServerSideFixedClipping``):
each client's update is clipped to ``clipping_norm`` before the wrapped strategy aggregates, and
Gaussian noise of standard deviation ``noise_multiplier * clipping_norm / num_sampled_clients`` is
added to the aggregate. It is itself a Strategy, so it wraps any other (McMahan et al., 2018)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np

from opml_fl_coordinator.strategy.base import Failure, FitIns, FitRes, Scalar, Strategy
from opml_fl_coordinator.weights import cast_like, global_norm, subtract
from opml_fl_coordinator_contract.weights import Weights


class DifferentialPrivacyFixedClipping(Strategy):
    """Clip each update's delta, aggregate with ``strategy``, add Gaussian noise to the result.

    Args:
        strategy: the wrapped strategy.
        noise_multiplier: noise std in units of the per-client sensitivity (>= 0; 1.0 or more for
            meaningful privacy).
        clipping_norm: largest L2 norm of one client's update (> 0).
        num_sampled_clients: clients per round the noise is calibrated for (> 0).
        seed: seed of the noise generator (None: fresh entropy).

    Raises:
        ValueError: any argument outside its range, or ``strategy`` not a Strategy.
    """

    def __init__(self, strategy: Strategy, *, noise_multiplier: float, clipping_norm: float,
                 num_sampled_clients: int, seed: int | None = None) -> None:
        if not isinstance(strategy, Strategy):
            raise ValueError(f"strategy must be a Strategy, but got {type(strategy).__name__}")
        if not isinstance(noise_multiplier, (int, float)) or not noise_multiplier >= 0:
            raise ValueError(f"noise_multiplier must be a number >= 0, but got {noise_multiplier!r}")
        if not isinstance(clipping_norm, (int, float)) or not clipping_norm > 0:
            raise ValueError(f"clipping_norm must be a number > 0, but got {clipping_norm!r}")
        if not isinstance(num_sampled_clients, int) or num_sampled_clients < 1:
            raise ValueError(f"num_sampled_clients must be an int >= 1, but got {num_sampled_clients!r}")
        self.strategy = strategy
        self.noise_multiplier = float(noise_multiplier)
        self.clipping_norm = float(clipping_norm)
        self.num_sampled_clients = num_sampled_clients
        self._rng = np.random.default_rng(seed)
        self._round_weights: Weights | None = None

    def __repr__(self) -> str:
        return (f"DifferentialPrivacyFixedClipping({self.strategy!r}, noise_multiplier={self.noise_multiplier}, "
                f"clipping_norm={self.clipping_norm})")

    @property
    def noise_stddev(self) -> float:
        return self.noise_multiplier * self.clipping_norm / self.num_sampled_clients

    def initialize(self, weights: Weights) -> Weights:
        self._round_weights = weights
        return self.strategy.initialize(weights)

    def configure_fit(self, server_round: int, weights: Weights, clients: Sequence[str]) -> list[FitIns]:
        self._round_weights = weights
        return self.strategy.configure_fit(server_round, weights, clients)

    def clip(self, result: FitRes) -> FitRes:
        """``result`` with its update (difference from the round's model) scaled to at most the norm.

        Raises:
            ValueError: weights of other shapes than the round's model.
        """
        if self._round_weights is None:
            raise ValueError("configure_fit (or initialize) must come before aggregate_fit")
        got, expected = [w.shape for w in result.weights], [w.shape for w in self._round_weights]
        if got != expected:
            raise ValueError(f"client {result.client_id!r} sent weights of shapes {got}, the round's are {expected}")
        delta = subtract(result.weights, self._round_weights)
        scale = min(1.0, self.clipping_norm / max(global_norm(delta), 1e-12))
        clipped = [np.asarray(base, np.float64) + scale * d for base, d in zip(self._round_weights, delta, strict=True)]
        return replace(result, weights=cast_like(clipped, result.weights))

    def aggregate_fit(self, server_round: int, results: Sequence[FitRes],
                      failures: Sequence[Failure]) -> tuple[Weights | None, dict[str, Scalar]]:
        aggregated, metrics = self.strategy.aggregate_fit(server_round, [self.clip(r) for r in results], failures)
        if aggregated is None:
            return None, metrics
        noisy = [np.asarray(w, np.float64) + self._rng.normal(0.0, self.noise_stddev, np.shape(w)) for w in aggregated]
        return cast_like(noisy, aggregated), {**metrics, "dp_noise_stddev": self.noise_stddev}

    def evaluate(self, server_round: int, weights: Weights) -> tuple[float, dict[str, Scalar]] | None:
        return self.strategy.evaluate(server_round, weights)

    def state(self) -> dict[str, Weights]:
        return self.strategy.state()

    def load_state(self, state: Mapping[str, Weights]) -> None:
        self.strategy.load_state(state)
