"""Profiles predicted on pool kinds a model version was not (fully) profiled on, by a performance
model that transfers (Iqbal et al., OpML '19): a model shift from a kind it was profiled on.

A kind's profile can be missing (no live worker of it at deploy, no room there) or cover fewer batch
sizes than the kind would run. Where the model has a full profile on another kind, its latency
there predicts the missing sizes: log target = a + b log source, fitted on every pair of sizes the
book knows on both kinds (the model's own partial points and those of other versions measured on
both), so a few measurements of the new kind, or none but the fleet's experience, size it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

import numpy as np

from opml_common.perfmodel import ModelShift, Sample, ServingConfig
from opml_inference_router.placement.fleet import Fleet
from opml_inference_router.placement.fleet_config import ModelVersion, PoolKind
from opml_inference_router.placement.plan import ModelDemand
from opml_inference_router.placement.profile import Profile, ProfileBook
from opml_inference_router_contract.model_config import ModelConfig

log = logging.getLogger(__name__)

PREFERENCE = ("int8", "fp16", "fp32")  # the worker's choice, cheapest first (runtime.session.PREFERENCE)


def kind_sizes(kind: PoolKind, config: ModelConfig) -> list[int]:
    """The batch sizes a worker of ``kind`` profiles (its fixed shapes up to the model's cap, else
    powers of two and the cap), as ``runtime.profiler.batch_ladder``."""
    limit = config.batch_limit
    if kind.batch_sizes:
        return [shape for shape in kind.batch_sizes if shape <= limit] or [limit]
    sizes = [1 << power for power in range(limit.bit_length()) if 1 << power < limit]
    return [*sizes, limit]


class _ProfileSource:
    """The source model: the source kind's measured profiles, read at each sample's batch size."""

    def __init__(self, profiles: ProfileBook, kind: str) -> None:
        self._by_name: dict[str, Profile] = {str(p.model): p for p in profiles if p.pool_kind == kind}

    def log_ms(self, samples: Sequence[Sample]) -> np.ndarray:
        return np.log([self._by_name[s.model].latency_ms(s.config.batch) for s in samples])


class ProfilePredictor:
    """Completes a :class:`ProfileBook` for the kinds each demand allows but lacks a full profile on.

    A predicted profile is never stored: it lives for one plan, and a real profile replaces it.
    ``serving(kind)`` says whether a kind's workers can take replicas now (the control plane: a live
    worker); a kind profiling skipped because its workers were down is not predicted onto them."""

    def __init__(self, *, fleet: Fleet, min_pairs: int = 3, serving: Callable[[str], bool] = lambda kind: True) -> None:
        self.fleet = fleet
        self.min_pairs = min_pairs
        self.serving = serving

    def complete(self, demands: Sequence[ModelDemand],
                 profiles: ProfileBook) -> tuple[ProfileBook, set[tuple[ModelVersion, str]]]:
        """``profiles`` plus the predicted ones, and the (model version, kind) pairs that were predicted."""
        completed, predicted = ProfileBook(profiles), set()
        for demand in demands:
            for name in demand.config.pool_kinds:
                kind = self.fleet.kinds.get(name)
                if kind is None or not self.fleet.workers_of(name) or not self.serving(name):
                    continue
                profile = self.predict(demand, kind, profiles)
                if profile is not None:
                    completed.add(profile, replace=True)
                    predicted.add((demand.model, name))
        return completed, predicted

    def predict(self, demand: ModelDemand, kind: PoolKind, profiles: ProfileBook) -> Profile | None:
        """The predicted profile of ``demand`` on ``kind``; None when it has a full one, no precision
        it could run there, no full profile elsewhere, or fewer than ``min_pairs`` pairs to fit on."""
        model, config = demand.model, demand.config
        wanted = kind_sizes(kind, config)
        have = profiles.get(model, kind.name)
        if have is not None and all(size in have.batch_latency_ms for size in wanted):
            return None
        precision = have.precision if have is not None else next(
            (p for p in PREFERENCE if p in kind.precisions and p in config.precisions), None)
        if precision is None:
            return None
        best = None
        for source in self.fleet.kinds:
            base = profiles.get(model, source)
            if source == kind.name or base is None or base.max_batch < wanted[-1]:
                continue
            pairs = self._pairs(profiles, source, kind.name)
            if len(pairs) >= self.min_pairs and (best is None or len(pairs) > len(best[2])):
                best = (source, base, pairs)
        if best is None:
            return None
        source, base, pairs = best
        if len({round(math.log(p.latency_ms), 9) for p in pairs}) < 2:
            return None
        shift = ModelShift(_ProfileSource(profiles, source)).fit(pairs)
        points = [Sample(str(model), 1.0, ServingConfig(size)) for size in wanted]
        table = dict(zip(wanted, (float(ms) for ms in shift.predict_ms(points)), strict=True))
        if have is not None:
            table.update(have.batch_latency_ms)  # measured points stay measured
        running = 0.0
        for size in sorted(table):
            running = table[size] = max(running, table[size])
        log.info("predicted %s on %s from its %s profile (shift fitted on %d pairs): %s ms", model, kind.name,
                 source, len(pairs), {size: round(ms, 3) for size, ms in sorted(table.items())})
        return Profile(model, kind.name, precision, table, have.memory_mib if have is not None else base.memory_mib)

    @staticmethod
    def _pairs(profiles: ProfileBook, source: str, target: str) -> list[Sample]:
        """Every measured target latency whose batch size the same version's source profile covers."""
        pairs = []
        for profile in profiles:
            if profile.pool_kind != target:
                continue
            base = profiles.get(profile.model, source)
            if base is None:
                continue
            pairs += [Sample(str(profile.model), 1.0, ServingConfig(size), ms)
                      for size, ms in profile.batch_latency_ms.items() if size <= base.max_batch]
        return pairs
