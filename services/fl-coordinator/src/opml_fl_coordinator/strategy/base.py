"""The aggregation-strategy ABC, in Flower's manner (flwr.server.strategy.Strategy).

A strategy decides what each selected client is asked to do (``configure_fit``), how the updates
that came back become the next global model (``aggregate_fit``) and how a model is scored on the
server (``evaluate``). *Which* clients take part is not its business: that is the selector's
(random or TiFL tiers, :mod:`opml_fl_coordinator.selection`), so every strategy works with every
selection policy and with the semi-asynchronous mode. Configuration is keyword-only and checked in
``__init__``; per-round settings are callables (``on_fit_config_fn``), never globals.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from opml_fl_coordinator_contract.weights import Weights

Scalar = bool | int | float | str
Config = dict[str, Scalar]
EvaluateFn = Callable[[int, Weights], "tuple[float, dict[str, Scalar]] | None"]


@dataclass(frozen=True)
class FitIns:
    """What one client is asked to do this round: start from ``weights``, train with ``config``."""

    client_id: str
    weights: Weights
    config: Config


@dataclass
class FitRes:
    """One client's update: its trained weights, how many examples it trained on, its metrics.

    ``staleness`` is how many global versions were made after the one the client started from
    (0 in synchronous rounds); strategies see results already rebased on the current model.
    """

    client_id: str
    weights: Weights
    num_examples: int
    metrics: dict[str, Scalar] = field(default_factory=dict)
    staleness: int = 0


@dataclass(frozen=True)
class Failure:
    """A selected client whose update is not used, and why (dropped, late, rejected)."""

    client_id: str
    reason: str


class Strategy(ABC):
    """How a federation turns client updates into a global model."""

    def initialize(self, weights: Weights) -> Weights:
        """Take the starting global model (and, after a restart, the last saved one); returns the
        model the first configured round starts from. Server optimizers keep it as their state."""
        return weights

    @abstractmethod
    def configure_fit(self, server_round: int, weights: Weights, clients: Sequence[str]) -> list[FitIns]:
        """One instruction per client in ``clients`` (the selector's choice), in that order.

        Raises:
            ValueError: ``server_round`` < 1.
        """

    @abstractmethod
    def aggregate_fit(self, server_round: int, results: Sequence[FitRes],
                      failures: Sequence[Failure]) -> tuple[Weights | None, dict[str, Scalar]]:
        """The next global model from this round's ``results`` (None: keep the current one, e.g.
        too few results), and aggregated metrics.

        Raises:
            ValueError: results whose weights do not all have the same shapes.
        """

    def evaluate(self, server_round: int, weights: Weights) -> tuple[float, dict[str, Scalar]] | None:
        """Server-side loss and metrics of ``weights`` (None when the strategy has no evaluate_fn)."""
        return None

    def state(self) -> dict[str, Weights]:
        """Arrays the strategy keeps between rounds (a server optimizer's moments), saved with each
        completed round so a restarted coordinator continues exactly."""
        return {}

    def load_state(self, state: Mapping[str, Weights]) -> None:
        """Restore what :meth:`state` returned (after :meth:`initialize` with the saved model).

        Raises:
            ValueError: ``state`` does not belong to this strategy.
        """
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, but got {sorted(state)}")


def check_same_shapes(results: Sequence[FitRes]) -> None:
    """Raises ValueError when the results' weights do not all have the first one's shapes."""
    if not results:
        return
    reference = [w.shape for w in results[0].weights]
    for result in results[1:]:
        got = [w.shape for w in result.weights]
        if got != reference:
            raise ValueError(f"client {result.client_id!r} sent weights of shapes {got}, the round's are {reference}")


def weighted_metrics(results: Sequence[FitRes]) -> dict[str, Scalar]:
    """Numeric metrics averaged with the clients' example counts as weights (Flower's usual
    ``fit_metrics_aggregation_fn``); non-numeric ones are left out."""
    totals: dict[str, float] = {}
    counts: dict[str, float] = {}
    for result in results:
        for name, value in result.metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value):
                totals[name] = totals.get(name, 0.0) + float(value) * result.num_examples
                counts[name] = counts.get(name, 0.0) + result.num_examples
    return {name: totals[name] / counts[name] for name in totals if counts[name] > 0}
