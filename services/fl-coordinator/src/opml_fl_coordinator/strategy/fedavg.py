"""FedAvg (McMahan et al., 2017) and FedProx (Li et al., 2020), as Flower's ``FedAvg``/``FedProx``."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from opml_fl_coordinator.strategy.base import (
    Config,
    EvaluateFn,
    Failure,
    FitIns,
    FitRes,
    Scalar,
    Strategy,
    check_same_shapes,
    weighted_metrics,
)
from opml_fl_coordinator.weights import cast_like
from opml_fl_coordinator_contract.weights import Weights


class FedAvg(Strategy):
    """The average of the clients' weights, each weighted by the examples it trained on.

    Args (keyword-only):
        min_fit_results: fewest usable updates a round needs; with fewer the model stays as it was.
        accept_failures: aggregate a round in which some selected clients failed (else keep the model).
        on_fit_config_fn: ``server_round -> config`` sent to every client (epochs, learning rate...).
        evaluate_fn: ``(server_round, weights) -> (loss, metrics) | None``, server-side evaluation.

    Raises:
        ValueError: ``min_fit_results`` < 1, or a callable argument that is not callable.
    """

    def __init__(self, *, min_fit_results: int = 1, accept_failures: bool = True,
                 on_fit_config_fn: Callable[[int], Config] | None = None,
                 evaluate_fn: EvaluateFn | None = None) -> None:
        if not isinstance(min_fit_results, int) or isinstance(min_fit_results, bool) or min_fit_results < 1:
            raise ValueError(f"min_fit_results must be an int >= 1, but got {min_fit_results!r}")
        for name, value in (("on_fit_config_fn", on_fit_config_fn), ("evaluate_fn", evaluate_fn)):
            if value is not None and not callable(value):
                raise ValueError(f"{name} must be callable or None, but got {type(value).__name__}")
        self.min_fit_results = min_fit_results
        self.accept_failures = accept_failures
        self.on_fit_config_fn = on_fit_config_fn
        self.evaluate_fn = evaluate_fn

    def __repr__(self) -> str:
        return f"{type(self).__name__}(min_fit_results={self.min_fit_results}, accept_failures={self.accept_failures})"

    def fit_config(self, server_round: int) -> Config:
        """The config every client gets this round (subclasses add their keys)."""
        config: Config = dict(self.on_fit_config_fn(server_round)) if self.on_fit_config_fn else {}
        config["server_round"] = server_round
        return config

    def configure_fit(self, server_round: int, weights: Weights, clients: Sequence[str]) -> list[FitIns]:
        if server_round < 1:
            raise ValueError(f"server_round must be >= 1, but got {server_round}")
        config = self.fit_config(server_round)
        return [FitIns(client_id, weights, dict(config)) for client_id in clients]

    def usable(self, results: Sequence[FitRes], failures: Sequence[Failure]) -> bool:
        """Whether this round's results may be aggregated at all."""
        if failures and not self.accept_failures:
            return False
        return len(results) >= self.min_fit_results

    def aggregate_fit(self, server_round: int, results: Sequence[FitRes],
                      failures: Sequence[Failure]) -> tuple[Weights | None, dict[str, Scalar]]:
        if not self.usable(results, failures):
            return None, {}
        check_same_shapes(results)
        return cast_like(self.combine(results), results[0].weights), weighted_metrics(results)

    def combine(self, results: Sequence[FitRes]) -> Weights:
        """The aggregate of ``results`` (same shapes, at least one), in float64."""
        total = sum(result.num_examples for result in results)
        if total <= 0:  # nobody reported examples: a plain mean
            return [np.mean([np.asarray(r.weights[i], np.float64) for r in results], axis=0)
                    for i in range(len(results[0].weights))]
        return [sum(np.asarray(r.weights[i], np.float64) * (r.num_examples / total) for r in results)
                for i in range(len(results[0].weights))]

    def evaluate(self, server_round: int, weights: Weights) -> tuple[float, dict[str, Scalar]] | None:
        return None if self.evaluate_fn is None else self.evaluate_fn(server_round, weights)


class FedProx(FedAvg):
    """FedAvg whose clients add the proximal term ``mu/2 * ||w - w_global||^2`` to their loss.

    The term is the clients' to apply (the SDK's Keras trainer does): the strategy only sends
    ``proximal_mu`` in every round's config; aggregation is FedAvg's.

    Raises:
        ValueError: ``proximal_mu`` < 0 (and FedAvg's rules).
    """

    def __init__(self, *, proximal_mu: float, **kwargs) -> None:
        super().__init__(**kwargs)
        if not isinstance(proximal_mu, (int, float)) or isinstance(proximal_mu, bool) or not proximal_mu >= 0:
            raise ValueError(f"proximal_mu must be a number >= 0, but got {proximal_mu!r}")
        self.proximal_mu = float(proximal_mu)

    def fit_config(self, server_round: int) -> Config:
        config = super().fit_config(server_round)
        config["proximal_mu"] = self.proximal_mu
        return config
