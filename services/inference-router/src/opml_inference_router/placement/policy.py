"""Placement policies: which pool kind, batch cap and replica count serve each model, who claims
capacity first, and which workers host the replicas.

A policy only ranks. The :class:`~opml_inference_router.placement.planner.Planner` owns capacity:
it offers a policy only workers with room and moves to the next option when an option does not
fit, so no policy can overfill a worker or put two replicas of a model on one worker.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence

from opml_common.errors import InvalidArgument
from opml_inference_router.placement.fleet import Fleet, WorkerRoom
from opml_inference_router.placement.fleet_config import ModelVersion, PoolKind
from opml_inference_router.placement.latency import Batching, BatchQueueModel, LatencyModel, ServiceCurve, batch_caps
from opml_inference_router.placement.plan import ModelDemand, Option
from opml_inference_router.placement.profile import Profile


class PlacementPolicy(ABC):
    """Decides where models run. In each planning round the planner calls :meth:`options` for
    every model version to place, then :meth:`order` once, then :meth:`rank_workers` for each
    option it tries, in that order."""

    @abstractmethod
    def options(self, demand: ModelDemand, profiles: Mapping[str, Profile], fleet: Fleet) -> list[Option]:
        """The ways this policy accepts to serve ``demand``, most preferred first.

        Called once per model version per round. ``profiles`` maps each pool kind that can host
        the model to its profile, in the model's order of preference: the planner has already
        left out kinds the model does not allow, kinds without workers, kinds that do not run a
        precision the model accepts (so int8-only accelerators see only models that allow int8)
        and kinds whose workers lack the memory for one replica. An empty list means the policy
        cannot serve the model on this fleet.

        Raises:
            InvalidArgument: a profile does not cover the batch sizes the policy needs.
        """

    @abstractmethod
    def order(self, options: Mapping[ModelVersion, Sequence[Option]]) -> list[ModelVersion]:
        """The order in which model versions claim capacity: every key of ``options`` once.

        Called once per round, after every :meth:`options` call; ``options`` keeps the order in
        which the demands were given.
        """

    @abstractmethod
    def rank_workers(self, option: Option, rooms: Sequence[WorkerRoom], current: frozenset[str]) -> list[WorkerRoom]:
        """``rooms`` (workers of ``option.pool_kind``, each with room for one more replica of the
        model) best first, each exactly once; the planner takes the replicas it still needs from the
        front, and asks again with the remaining rooms when a model has more replicas than the
        kind has workers.

        Called for each option the planner tries. ``current`` holds the workers the model's
        replicas run on now (empty on first deploy), so a policy can keep them where they are.
        """


class CostAwareSloPolicy(PlacementPolicy):
    """Meets each model's p99 SLO at its rate at the lowest cost.

    For every compatible kind it picks the batch cap that needs the fewest replicas to keep the
    predicted p99 within ``slo_headroom`` x the SLO, then among those the one that keeps it there up
    to the highest rate (the most headroom for a cost or a rate the profile underestimates: a batch
    cap of 1 that met the SLO on paper served half of what a cap of 32 did at the same cost), then
    the lowest p99, and offers
    the kinds cheapest first. Models claim capacity in order of *regret* (what they lose if they
    do not get their cheapest kind, as in Vogel's approximation), so scarce cheap capacity such as
    accelerator slots goes where it saves most; a model with a single option goes first. Replicas
    go on the workers the model already uses, then on the fullest workers (best fit), so fewer
    workers are kept busy. With ``site_rtt_ms`` (a site's round trip from the router,
    :func:`~.sites.site_distance`), on the nearest site first, then as above.
    """

    def __init__(self, *, latency_model: LatencyModel | None = None, slo_headroom: float = 0.9,
                 site_rtt_ms: Callable[[str], float] | None = None) -> None:
        """Raises: InvalidArgument when ``slo_headroom`` is not in (0, 1]."""
        if not 0 < slo_headroom <= 1:
            raise InvalidArgument("slo_headroom", f"must be in (0, 1], but got {slo_headroom}")
        self.latency_model = latency_model or BatchQueueModel()
        self.slo_headroom = slo_headroom
        self.site_rtt_ms = site_rtt_ms

    def options(self, demand: ModelDemand, profiles: Mapping[str, Profile], fleet: Fleet) -> list[Option]:
        target_ms = demand.config.slo.p99_ms * self.slo_headroom
        options = []
        for name, profile in profiles.items():
            kind = fleet.kinds[name]
            option = self._size(demand, kind, profile, target_ms, len(fleet.workers_of(kind.name)) * kind.slots)
            if option is not None:
                options.append(option)
        return sorted(options, key=lambda option: (option.cost_per_hour, option.predicted_p99_ms))

    def _size(self, demand: ModelDemand, kind: PoolKind, profile: Profile, target_ms: float,
              slots: int) -> Option | None:
        """The cheapest replica set on one kind, or None when no batch cap meets the target within
        the kind's ``slots``."""
        service = ServiceCurve(profile, kind)
        delay = demand.config.queue_delay_ms
        best: tuple[int, float, Batching, float] | None = None  # replicas, p99, batching, per-replica rate
        for cap in batch_caps(kind, demand.config.batch_limit, profile):
            batching = Batching(cap, delay)
            at_full_throughput = math.ceil(demand.rate_rps / self.latency_model.capacity_rps(service, batching))
            if best is not None and at_full_throughput > best[0]:
                continue  # this cap needs more replicas than the best so far even when always full
            rate = self.latency_model.max_rate_rps(service, batching, target_ms)
            if rate <= 0:
                continue
            replicas = max(1, math.ceil(demand.rate_rps / rate))
            p99 = self.latency_model.p99_ms(service, batching, demand.rate_rps / replicas)
            if best is None or (replicas, -rate, p99) < (best[0], -best[3], best[1]):
                best = (replicas, p99, batching, rate)
        if best is None or best[0] > slots:
            return None
        replicas, p99, batching, rate = best
        return Option(kind.name, profile.precision, batching.max_batch, delay, replicas, rate, p99,
                      profile.memory_mib, replicas * kind.slot_cost_per_hour)

    def order(self, options: Mapping[ModelVersion, Sequence[Option]]) -> list[ModelVersion]:
        def regret(model: ModelVersion) -> tuple[float, float]:
            choices = options[model]
            if not choices:
                return (0.0, 0.0)
            if len(choices) == 1:
                return (math.inf, choices[0].cost_per_hour)
            return (choices[1].cost_per_hour - choices[0].cost_per_hour, choices[0].cost_per_hour)

        return sorted(options, key=regret, reverse=True)

    def rank_workers(self, option: Option, rooms: Sequence[WorkerRoom], current: frozenset[str]) -> list[WorkerRoom]:
        distance = self.site_rtt_ms or (lambda site: 0.0)
        return sorted(rooms, key=lambda room: (distance(room.worker.site), room.worker.id not in current,
                                               room.free_slots, room.free_memory_mib))


class GreedyFirstFitPolicy(PlacementPolicy):
    """The baseline: models in the order they come, each on the first kind it lists that has room,
    sized for ``target_utilization`` of a replica's full-batch throughput (what a utilization
    autoscaler does), on the first workers with room. It ignores the SLO and the cost."""

    def __init__(self, *, latency_model: LatencyModel | None = None, target_utilization: float = 0.7) -> None:
        """Raises: InvalidArgument when ``target_utilization`` is not in (0, 1]."""
        if not 0 < target_utilization <= 1:
            raise InvalidArgument("target_utilization", f"must be in (0, 1], but got {target_utilization}")
        self.latency_model = latency_model or BatchQueueModel()
        self.target_utilization = target_utilization

    def options(self, demand: ModelDemand, profiles: Mapping[str, Profile], fleet: Fleet) -> list[Option]:
        options = []
        for name, profile in profiles.items():
            kind = fleet.kinds[name]
            caps = batch_caps(kind, demand.config.batch_limit, profile)
            if not caps:
                continue
            service, batching = ServiceCurve(profile, kind), Batching(caps[-1], demand.config.queue_delay_ms)
            rate = self.latency_model.capacity_rps(service, batching) * self.target_utilization
            replicas = max(1, math.ceil(demand.rate_rps / rate))
            if replicas > len(fleet.workers_of(kind.name)) * kind.slots:
                continue
            p99 = self.latency_model.p99_ms(service, batching, demand.rate_rps / replicas)
            options.append(Option(kind.name, profile.precision, batching.max_batch, batching.queue_delay_ms,
                                  replicas, rate, p99, profile.memory_mib, replicas * kind.slot_cost_per_hour))
        return options

    def order(self, options: Mapping[ModelVersion, Sequence[Option]]) -> list[ModelVersion]:
        return list(options)

    def rank_workers(self, option: Option, rooms: Sequence[WorkerRoom], current: frozenset[str]) -> list[WorkerRoom]:
        return list(rooms)
