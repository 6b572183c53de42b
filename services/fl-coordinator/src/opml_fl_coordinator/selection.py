"""Client selection policies: which present clients train in a round.

:class:`RandomSelection` is FedAvg's uniform sample (the baseline). :class:`TiflSelection` is
TiFL's adaptive tier selection (Chai et al., HPDC '20, Algorithm 2): clients are grouped into
tiers by their profiled round time; each round one tier is drawn, with probabilities that favour
tiers whose clients' data the global model fits worst (lowest accuracy), bounded by each tier's
credits; the clients of the round are sampled from that tier only, so a round waits for clients of
similar speed. Tiers and probabilities are recomputed every ``tier_interval`` rounds.

Clients are profiled before they are tiered, as TiFL's profiling phase does: while some present
clients have no measured round time, the round is a profiling round made of them (at most
``profile_batch`` at once; it trains and is aggregated like any other), so a new client is timed
once instead of being guessed fast or slow.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np

from opml_fl_coordinator.profiles import ClientProfile


class Selection(ABC):
    """A selection policy. Its randomness is its own generator, saved with each round."""

    def __init__(self, *, clients_per_round: int, seed: int = 0) -> None:
        if not isinstance(clients_per_round, int) or clients_per_round < 1:
            raise ValueError(f"clients_per_round must be an int >= 1, but got {clients_per_round!r}")
        self.clients_per_round = clients_per_round
        self.rng = np.random.default_rng(seed)

    @abstractmethod
    def select(self, server_round: int, candidates: Sequence[ClientProfile], *, count: int | None = None
               ) -> tuple[list[str], int | None]:
        """Up to ``count`` (default ``clients_per_round``) client ids among ``candidates``, and the
        tier they came from (None when the policy has no tiers).

        Raises:
            ValueError: ``server_round`` < 1.
        """

    def state(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state` returned.

        Raises:
            KeyError: ``state`` lacks the generator's state.
        """
        self.rng.bit_generator.state = state["rng"]


class RandomSelection(Selection):
    """Uniformly at random, as Flower's FedAvg samples clients."""

    def select(self, server_round: int, candidates: Sequence[ClientProfile], *, count: int | None = None
               ) -> tuple[list[str], int | None]:
        if server_round < 1:
            raise ValueError(f"server_round must be >= 1, but got {server_round}")
        ids = sorted(p.client_id for p in candidates)
        take = min(count or self.clients_per_round, len(ids))
        return [str(i) for i in self.rng.choice(ids, size=take, replace=False)] if take else [], None


class TiflSelection(Selection):
    """TiFL's adaptive tier selection.

    Args (keyword-only):
        clients_per_round: clients drawn from the chosen tier.
        tiers: number of tiers (clients split by profiled round time into this many groups of
            about equal size; clients not yet profiled count as fastest, so they get profiled).
        credits_per_tier: times each tier may be chosen (None: unlimited). When every tier's
            credits are spent, probabilities alone decide.
        tier_interval: rounds between re-tiering and new probabilities.
        profile_batch: most unprofiled clients in one profiling round (default 10 x clients_per_round).
        seed: seed of the policy's generator.

    Raises:
        ValueError: a count < 1.
    """

    def __init__(self, *, clients_per_round: int, tiers: int = 3, credits_per_tier: int | None = None,
                 tier_interval: int = 3, profile_batch: int | None = None, seed: int = 0) -> None:
        super().__init__(clients_per_round=clients_per_round, seed=seed)
        self.profile_batch = profile_batch or 10 * clients_per_round
        if not isinstance(self.profile_batch, int) or self.profile_batch < 1:
            raise ValueError(f"profile_batch must be an int >= 1, but got {profile_batch!r}")
        for name, value in (("tiers", tiers), ("tier_interval", tier_interval)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, but got {value!r}")
        if credits_per_tier is not None and (not isinstance(credits_per_tier, int) or credits_per_tier < 1):
            raise ValueError(f"credits_per_tier must be an int >= 1 or None, but got {credits_per_tier!r}")
        self.tiers = tiers
        self.tier_interval = tier_interval
        self.credits: list[int | None] = [credits_per_tier] * tiers
        self.assignment: dict[str, int] = {}
        self.probabilities: list[float] = [1.0 / tiers] * tiers
        self._last_update = 0

    def tier_of(self, candidates: Sequence[ClientProfile]) -> dict[str, int]:
        """Client id -> tier (0 fastest), by profiled round time, in groups of about equal size
        (a client not yet profiled counts as fastest until its profiling round)."""
        order = sorted(candidates, key=lambda p: (p.round_time_s if p.round_time_s is not None else -1.0,
                                                  p.client_id))
        count = min(self.tiers, max(1, len(order)))
        return {p.client_id: min(i * count // max(1, len(order)), count - 1) for i, p in enumerate(order)}

    def update_probabilities(self, candidates: Sequence[ClientProfile]) -> None:
        """TiFL's rule: rank tiers by the mean accuracy their clients last reported; the tier with
        the lowest accuracy gets the largest share (``n - rank`` over the sum), tiers without credits
        none. Tiers with no accuracy yet rank as lowest (they have not been seen)."""
        self.assignment = self.tier_of(candidates)
        accuracy = []
        for tier in range(self.tiers):
            values = [p.accuracy for p in candidates if self.assignment.get(p.client_id) == tier
                      and p.accuracy is not None]
            members = any(self.assignment.get(p.client_id) == tier for p in candidates)
            accuracy.append(float(np.mean(values)) if values else (-1.0 if members else np.inf))
        ranks = np.argsort(np.argsort(accuracy, kind="stable"), kind="stable")
        shares = np.array([self.tiers - rank if np.isfinite(a) else 0.0 for rank, a in zip(ranks, accuracy)])
        with_credit = np.array([1.0 if c is None or c > 0 else 0.0 for c in self.credits])
        if (shares * with_credit).sum() > 0:
            shares = shares * with_credit
        self.probabilities = list(shares / shares.sum()) if shares.sum() > 0 else [1.0 / self.tiers] * self.tiers

    def select(self, server_round: int, candidates: Sequence[ClientProfile], *, count: int | None = None
               ) -> tuple[list[str], int | None]:
        if server_round < 1:
            raise ValueError(f"server_round must be >= 1, but got {server_round}")
        if not candidates:
            return [], None
        unprofiled = sorted(p.client_id for p in candidates if p.round_time_s is None and p.selected == 0)
        if unprofiled:  # TiFL's profiling phase, for whoever has not been timed yet
            # in semi-async mode ``count`` is the free training slots: no more tasks than that
            take = min(len(unprofiled), self.profile_batch, count or self.profile_batch)
            return [str(i) for i in self.rng.choice(unprofiled, size=take, replace=False)], None
        known = {p.client_id for p in candidates}
        if (server_round - self._last_update >= self.tier_interval or not self.assignment
                or not known <= set(self.assignment)):
            self.update_probabilities(candidates)
            self._last_update = server_round
        by_tier: dict[int, list[str]] = {}
        for client_id in sorted(known):
            by_tier.setdefault(self.assignment[client_id], []).append(client_id)
        weights = np.array([self.probabilities[t] if t in by_tier else 0.0 for t in range(self.tiers)])
        if weights.sum() <= 0:
            weights = np.array([1.0 if t in by_tier else 0.0 for t in range(self.tiers)])
        tier = int(self.rng.choice(self.tiers, p=weights / weights.sum()))
        if self.credits[tier] is not None:
            self.credits[tier] = max(0, self.credits[tier] - 1)  # type: ignore[operator]
        members = by_tier[tier]
        take = min(count or self.clients_per_round, len(members))
        return [str(i) for i in self.rng.choice(members, size=take, replace=False)], tier

    def state(self) -> dict[str, Any]:
        return {**super().state(), "credits": list(self.credits), "assignment": dict(self.assignment),
                "probabilities": [float(p) for p in self.probabilities], "last_update": self._last_update}

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        self.credits = list(state["credits"])
        self.assignment = {str(k): int(v) for k, v in state["assignment"].items()}
        self.probabilities = [float(p) for p in state["probabilities"]]
        self._last_update = int(state["last_update"])
