"""Adaptive server optimizers (Reddi et al., 2021, "Adaptive Federated Optimization"): FedAdam and
FedYogi, as Flower's ``FedOpt`` family. The FedAvg aggregate gives a pseudo-gradient (its
difference from the current model) that a server-side Adam or Yogi step applies."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

import numpy as np

from opml_fl_coordinator.strategy.base import Failure, FitRes, Scalar
from opml_fl_coordinator.strategy.fedavg import FedAvg
from opml_fl_coordinator.weights import cast_like
from opml_fl_coordinator_contract.weights import Weights


def _number(name: str, value: object, *, low: float, high: float | None = None, low_open: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and (high is None or value < high)
    if not ok:
        bound = f"{'>' if low_open else '>='} {low:g}" + (f" and < {high:g}" if high is not None else "")
        raise ValueError(f"{name} must be a number {bound}, but got {value!r}")
    return float(value)  # type: ignore[arg-type]


class FedOpt(FedAvg, ABC):
    """Base of the server optimizers: keeps the current model and the first and second moments.

    Abstract: a server optimizer is its rule for the second moment (:meth:`second_moment`), so only
    its subclasses (:class:`FedAdam`, :class:`FedYogi`) can be made; a bare ``FedOpt`` would fail at
    its first aggregation.

    Args (keyword-only, with FedAvg's): ``eta`` server learning rate, ``beta_1``/``beta_2`` moment
    decays, ``tau`` adaptivity (added to the root of the second moment).

    Raises:
        ValueError: ``eta`` or ``tau`` <= 0, a beta outside [0, 1) (and FedAvg's rules).
    """

    def __init__(self, *, eta: float = 1e-1, beta_1: float = 0.9, beta_2: float = 0.99, tau: float = 1e-3,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.eta = _number("eta", eta, low=0, low_open=True)
        self.beta_1 = _number("beta_1", beta_1, low=0, high=1)
        self.beta_2 = _number("beta_2", beta_2, low=0, high=1)
        self.tau = _number("tau", tau, low=0, low_open=True)
        self.current: Weights | None = None
        self.m_t: Weights | None = None
        self.v_t: Weights | None = None

    def initialize(self, weights: Weights) -> Weights:
        self.current = [np.asarray(w, np.float64) for w in weights]
        return weights

    def aggregate_fit(self, server_round: int, results: Sequence[FitRes],
                      failures: Sequence[Failure]) -> tuple[Weights | None, dict[str, Scalar]]:
        averaged, metrics = super().aggregate_fit(server_round, results, failures)
        if averaged is None:
            return None, {}
        if self.current is None:
            raise ValueError(f"{type(self).__name__}.initialize must be called before aggregate_fit")
        delta = [np.asarray(a, np.float64) - c for a, c in zip(averaged, self.current, strict=True)]
        if self.m_t is None or self.v_t is None:
            self.m_t = [np.zeros_like(d) for d in delta]
            self.v_t = [np.zeros_like(d) for d in delta]
        self.m_t = [self.beta_1 * m + (1 - self.beta_1) * d for m, d in zip(self.m_t, delta, strict=True)]
        self.v_t = [self.second_moment(v, d) for v, d in zip(self.v_t, delta, strict=True)]
        self.current = [c + self.eta * m / (np.sqrt(v) + self.tau)
                        for c, m, v in zip(self.current, self.m_t, self.v_t, strict=True)]
        return cast_like(self.current, results[0].weights), metrics

    @abstractmethod
    def second_moment(self, v: np.ndarray, delta: np.ndarray) -> np.ndarray:
        """The next second moment from the last one ``v`` and this round's pseudo-gradient ``delta``."""

    def state(self) -> dict[str, Weights]:
        return {} if self.m_t is None or self.v_t is None else {"m_t": list(self.m_t), "v_t": list(self.v_t)}

    def load_state(self, state: Mapping[str, Weights]) -> None:
        if not state:
            self.m_t = self.v_t = None
            return
        if set(state) != {"m_t", "v_t"}:
            raise ValueError(f"{type(self).__name__} state must hold m_t and v_t, but got {sorted(state)}")
        self.m_t = [np.asarray(m, np.float64) for m in state["m_t"]]
        self.v_t = [np.asarray(v, np.float64) for v in state["v_t"]]


class FedAdam(FedOpt):
    """Server-side Adam: ``v <- beta_2 v + (1 - beta_2) delta^2``."""

    def second_moment(self, v: np.ndarray, delta: np.ndarray) -> np.ndarray:
        return self.beta_2 * v + (1 - self.beta_2) * np.square(delta)


class FedYogi(FedOpt):
    """Server-side Yogi: ``v <- v - (1 - beta_2) delta^2 sign(v - delta^2)`` (grows more slowly
    than Adam's, so a burst of large updates moves the effective rate less)."""

    def second_moment(self, v: np.ndarray, delta: np.ndarray) -> np.ndarray:
        squared = np.square(delta)
        return v - (1 - self.beta_2) * squared * np.sign(v - squared)
