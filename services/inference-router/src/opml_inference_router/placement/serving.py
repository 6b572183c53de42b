"""Serving configurations chosen per replica set: the onnxruntime session options (intra-op threads,
graph optimization level, execution mode) and, where the model and the kind allow another one, the
precision that a performance model (Iqbal et al., OpML '19; ``opml_common.perfmodel``) predicts
best for the model's SLO at its expected load on a pool kind.

The profile a version was placed on was measured with the worker's defaults (the slot's share of
cores as intra-op threads, all graph optimizations, sequential execution, the cheapest precision).
A configuration ``c`` turns it into ``profile(n) x predicted(c, n) / predicted(default, n)`` at each
batch size ``n``: the performance model says how much faster or slower ``c`` runs a batch, the
profile keeps what the request path costs. The placement policy sizes each such profile as it sizes
any (batch cap, replicas); the configuration whose replica set needs the fewest replicas, then
takes the highest rate within the SLO, then has the lowest p99, is chosen. The incumbent (the
configuration the version runs with now, else the defaults) stays unless another needs fewer
replicas or takes ``min_gain`` more rate: a prediction within its own error is no reason to reload
a replica. Threads never exceed the slot's share (``slot_threads``), so replicas do not take each
other's cores; parallel execution needs two threads (onnxruntime runs it with one as sequential).
Where no measurements exist, the defaults stay and the choice says so.

Transport-free: the control plane predicts each (version, kind)'s :class:`ServingTable` before it
plans (performance models are fitted on a thread) and hands the chooser a lookup.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from opml_common.errors import InvalidArgument
from opml_common.perfmodel import ServingConfig
from opml_common.perfmodel.space import EXECUTION_MODES, OPT_LEVELS, PRECISIONS
from opml_inference_router.placement.fleet import Fleet
from opml_inference_router.placement.fleet_config import ModelVersion, PoolKind
from opml_inference_router.placement.plan import ModelDemand, Option, SessionChoice
from opml_inference_router.placement.predicted import kind_sizes
from opml_inference_router.placement.profile import Profile

__all__ = ["ServingConfigChooser", "ServingTable", "SessionChoice", "default_session"]


def default_session(threads: int, basis: str) -> SessionChoice:
    """The worker's own options: ``threads`` (the slot's share), all optimizations, sequential."""
    return SessionChoice(threads, "all", "sequential", basis=basis)


@dataclass(frozen=True)
class ServingTable:
    """Predicted mean time of one batch (ms) of a model version on a pool kind, per serving
    configuration, and what predicted it (``basis``, e.g. the performance model's fit)."""

    latency_ms: Mapping[ServingConfig, float]
    basis: str

    def __post_init__(self) -> None:
        for config, ms in self.latency_ms.items():
            if not (math.isfinite(ms) and ms > 0):
                raise InvalidArgument(f"latency_ms[{config}]", f"must be a positive finite number, but got {ms!r}")
        object.__setattr__(self, "latency_ms", MappingProxyType(dict(self.latency_ms)))


@dataclass(frozen=True)
class _Candidate:
    session: SessionChoice
    precision: str
    profile: Profile
    option: Option | None

    def score(self) -> tuple[float, float, float]:
        """Lower is better: replicas, then minus the rate one replica takes within the SLO, then p99."""
        if self.option is None:
            return (math.inf, 0.0, math.inf)
        return (self.option.replicas, -self.option.replica_capacity_rps, self.option.predicted_p99_ms)


class ServingConfigChooser:
    """Chooses, per model version and pool kind, the serving configuration its replicas load with.

    ``policy`` sizes candidate profiles (any :class:`~.policy.PlacementPolicy`: ``options`` with one
    kind); ``slot_threads(kind)`` is the intra-op threads one slot of the kind has (the defaults'
    threads and the most a configuration may take); ``tables(model, kind)`` the predictions the
    control plane made (None: no measurements to predict from).

    Raises (on construction): InvalidArgument when ``min_gain`` is negative.
    """

    def __init__(self, *, fleet: Fleet, policy, slot_threads: Callable[[str], int],
                 tables: Callable[[ModelVersion, str], ServingTable | None], min_gain: float = 0.05) -> None:
        if not min_gain >= 0:
            raise InvalidArgument("min_gain", f"must be >= 0, but got {min_gain}")
        self.fleet, self.policy = fleet, policy
        self.slot_threads, self.tables = slot_threads, tables
        self.min_gain = min_gain

    def candidates(self, demand: ModelDemand, kind: PoolKind) -> list[ServingConfig]:
        """Every configuration a table for ``demand`` on ``kind`` must predict: each batch size the
        kind profiles, threads 1 to the slot's, every level and mode (parallel with 2 threads or
        more), each precision both allow."""
        if not any(p in kind.precisions and p in demand.config.precisions for p in PRECISIONS):
            return []  # a precision performance models do not cover (fp16, bf16): nothing to predict
        return [ServingConfig(batch, session.threads, session.opt_level, session.execution_mode, precision)
                for session, precision in self._sessions(demand, kind, "fp32", self.slot_threads(kind.name))
                for batch in kind_sizes(kind, demand.config)]

    def choose(self, demand: ModelDemand, kind: PoolKind, profile: Profile,
               incumbent: Option | None = None) -> tuple[Profile, SessionChoice]:
        """The profile to size ``demand`` on ``kind`` with (in the precision chosen) and the session
        options chosen: ``profile`` itself and the defaults when nothing predicts better.
        ``incumbent``: the option the version runs with on the kind now, kept unless beaten as the
        module says."""
        threads = self.slot_threads(kind.name)
        default = default_session(threads, "")
        table = self.tables(demand.model, kind.name)
        if table is None:
            return profile, replace(default, basis=f"defaults: no serving-configuration measurements of "
                                                   f"{demand.model} to predict {kind.name} from")
        base = {size: table.latency_ms.get(_config(size, default, profile.precision))
                for size in profile.batch_latency_ms}
        if any(ms is None for ms in base.values()):
            return profile, replace(default, basis=f"defaults: {table.basis} does not cover the "
                                                   f"{profile.precision} defaults at the profile's batch sizes")
        found = [self._candidate(demand, kind, profile, table, base, session, precision)
                 for session, precision in self._sessions(demand, kind, profile.precision, threads)]
        found = [c for c in found if c is not None]
        if not found:
            return profile, replace(default, basis=f"defaults: {table.basis} predicts none of the candidates")
        keep, kept_precision = default, profile.precision
        if incumbent is not None and 0 < incumbent.session.threads <= threads:
            keep, kept_precision = incumbent.session, incumbent.precision
        current = next((c for c in found if c.session == keep and c.precision == kept_precision), None)
        best = min(found, key=lambda c: (c.score(), _preference(c, default, profile.precision)))
        summary = (f"predicted best of {len(found)} for p99 <= {demand.config.slo.p99_ms:g} ms at "
                   f"{demand.rate_rps:g} rps ({table.basis})")
        if current is not None and current is not best and not self._beats(best, current):
            best, summary = current, f"kept within {self.min_gain:.0%} of the {summary}"
        if best.session == default and best.precision == profile.precision:
            summary = f"defaults {summary}"
        return best.profile, replace(best.session, basis=summary)

    def _beats(self, challenger: _Candidate, current: _Candidate) -> bool:
        if challenger.option is None:
            return False
        if current.option is None or challenger.option.replicas < current.option.replicas:
            return True
        return (challenger.option.replicas == current.option.replicas and challenger.option.replica_capacity_rps
                > current.option.replica_capacity_rps * (1 + self.min_gain))

    def _sessions(self, demand: ModelDemand, kind: PoolKind, precision: str, threads: int):
        precisions = [p for p in PRECISIONS if p in kind.precisions and p in demand.config.precisions]
        for each in precisions or [precision]:
            for count in range(1, threads + 1):
                for level in OPT_LEVELS:
                    for mode in EXECUTION_MODES[:1] if count == 1 else EXECUTION_MODES:
                        yield SessionChoice(count, level, mode), each

    def _candidate(self, demand: ModelDemand, kind: PoolKind, profile: Profile, table: ServingTable,
                   base: Mapping[int, float | None], session: SessionChoice, precision: str) -> _Candidate | None:
        table_ms = {size: table.latency_ms.get(_config(size, session, precision)) for size in base}
        if any(ms is None for ms in table_ms.values()):
            return None
        latencies, running = {}, 0.0
        for size in sorted(base):
            running = latencies[size] = max(running, profile.batch_latency_ms[size] * table_ms[size] / base[size])
        adjusted = Profile(profile.model, profile.pool_kind, precision, latencies, profile.memory_mib)
        options = self.policy.options(demand, {kind.name: adjusted}, self.fleet)
        return _Candidate(session, precision, adjusted, options[0] if options else None)


def _config(batch: int, session: SessionChoice, precision: str) -> ServingConfig:
    return ServingConfig(batch, session.threads, session.opt_level, session.execution_mode, precision)


def _preference(candidate: _Candidate, default: SessionChoice, precision: str) -> tuple:
    """Among equal scores: the defaults, then fewer threads, more optimization, sequential, the
    profiled precision."""
    session = candidate.session
    return (not (session == default and candidate.precision == precision), session.threads,
            -OPT_LEVELS.index(session.opt_level), EXECUTION_MODES.index(session.execution_mode),
            candidate.precision != precision)
