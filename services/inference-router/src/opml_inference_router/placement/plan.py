"""What placement consumes (demands) and produces (options, replica sets, plans)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from opml_common.errors import InvalidArgument
from opml_inference_router.placement.fleet import Fleet
from opml_inference_router.placement.fleet_config import ModelVersion
from opml_inference_router_contract.model_config import ModelConfig, Precision


@dataclass(frozen=True)
class ModelDemand:
    """A model version to place, and the rate it must serve within its SLO."""

    config: ModelConfig
    version: int
    rate_rps: float

    def __post_init__(self) -> None:
        if not self.rate_rps >= 0:
            raise InvalidArgument("rate_rps", f"must be >= 0, but got {self.rate_rps}")

    @property
    def model(self) -> ModelVersion:
        return ModelVersion(self.config.name, self.version)


def demands_for(config: ModelConfig, available_versions: Sequence[int]) -> list[ModelDemand]:
    """One demand per version the config's version policy serves, each at the expected rate.

    Raises:
        NotFound: the version policy names a version that is not available.
    """
    return [ModelDemand(config, version, config.expected_rate_rps)
            for version in config.version_policy.select(available_versions)]


@dataclass(frozen=True, order=True)
class SessionChoice:
    """The onnxruntime session options a replica loads with: intra-op ``threads`` (0: the worker's
    own, its slot's share of cores), graph optimization level, execution mode; ``basis`` says why
    they were chosen (not compared)."""

    threads: int = 0
    opt_level: str = "all"
    execution_mode: str = "sequential"
    basis: str = field(default="the worker's defaults", compare=False)

    def __str__(self) -> str:
        threads = f"{self.threads} threads" if self.threads else "the worker's threads"
        return f"{threads}, opt {self.opt_level}, {self.execution_mode}"


@dataclass(frozen=True)
class Option:
    """One way to serve a model version: ``replicas`` replicas on ``pool_kind``, each batching up to
    ``max_batch``. ``replica_capacity_rps`` is the rate one replica takes while the policy still
    believes the SLO holds (the planner and the move planner count capacity in it). ``session``:
    the session options its replicas load with (a planner with a chooser sets them, :mod:`.serving`)."""

    pool_kind: str
    precision: Precision
    max_batch: int
    queue_delay_ms: float
    replicas: int
    replica_capacity_rps: float
    predicted_p99_ms: float
    memory_mib: float
    cost_per_hour: float
    session: SessionChoice = SessionChoice()


@dataclass(frozen=True)
class ReplicaSet:
    """A placed model version: the option chosen, the workers its replicas run on, the planned rate.

    ``short``: why it runs fewer replicas than it did before a worker it was on was lost (the rest
    found no room on the usable workers; '' when it runs what the plan gave it), and ``lost``: those
    workers, where it grows back once they may be used again (:class:`~.planner.Replanner`'s ``regrow``).

    ``groups``: the version's other instance groups (its config's ``instance_groups``), each a replica set
    of its own kind and precision on its own workers; the version serves on this set's replicas and theirs."""

    model: ModelVersion
    option: Option
    workers: tuple[str, ...]
    rate_rps: float
    short: str = ""
    lost: tuple[str, ...] = ()
    groups: tuple[ReplicaSet, ...] = ()

    @property
    def capacity_rps(self) -> float:
        return sum(part.option.replica_capacity_rps * len(part.workers) for part in self.parts())

    def parts(self) -> tuple[ReplicaSet, ...]:
        """This set and its groups: one replica set per kind and precision the version runs on."""
        return (self, *self.groups)

    @property
    def all_workers(self) -> tuple[str, ...]:
        """The workers of every part's replicas."""
        return tuple(worker for part in self.parts() for worker in part.workers)


@dataclass(frozen=True)
class KindUsage:
    """How much of one pool kind a plan uses."""

    kind: str
    workers: int
    active_workers: int
    slots: int
    used_slots: int
    memory_mib: float
    used_memory_mib: float

    @property
    def slot_utilization(self) -> float:
        return self.used_slots / self.slots if self.slots else 0.0


@dataclass(frozen=True)
class Plan:
    """Where every model version runs, and those that could not be placed, each with the reason."""

    placements: Mapping[ModelVersion, ReplicaSet]
    unplaced: Mapping[ModelVersion, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "placements", MappingProxyType(dict(self.placements)))
        object.__setattr__(self, "unplaced", MappingProxyType(dict(self.unplaced)))

    @property
    def cost_per_hour(self) -> float:
        """What the placed replicas cost: each its slot's share of its worker."""
        return sum(part.option.cost_per_hour for replica_set in self.placements.values()
                   for part in replica_set.parts())

    def replicas(self) -> Iterator[tuple[ReplicaSet, str]]:
        """Every replica as (its replica set, or the instance group it belongs to, and its worker id)."""
        for replica_set in self.placements.values():
            for part in replica_set.parts():
                for worker_id in part.workers:
                    yield part, worker_id

    def active_worker_cost_per_hour(self, fleet: Fleet) -> float:
        """What the workers hosting at least one replica cost (the others can be released)."""
        busy = {worker_id for _, worker_id in self.replicas()}
        return sum(fleet.worker(worker_id).kind.cost_per_hour for worker_id in busy)

    def usage(self, fleet: Fleet) -> dict[str, KindUsage]:
        """Slots, memory and active workers used, per pool kind."""
        slots: dict[str, int] = {}
        memory: dict[str, float] = {}
        for replica_set, worker_id in self.replicas():
            slots[worker_id] = slots.get(worker_id, 0) + 1
            memory[worker_id] = memory.get(worker_id, 0.0) + replica_set.option.memory_mib
        usage = {}
        for kind in fleet.kinds.values():
            workers = fleet.workers_of(kind.name)
            usage[kind.name] = KindUsage(
                kind=kind.name,
                workers=len(workers),
                active_workers=sum(1 for worker in workers if worker.id in slots),
                slots=len(workers) * kind.slots,
                used_slots=sum(slots.get(worker.id, 0) for worker in workers),
                memory_mib=float(len(workers) * kind.memory_mib),
                used_memory_mib=sum(memory.get(worker.id, 0.0) for worker in workers),
            )
        return usage
