"""The fleet: workers grouped in pools of a kind, and the room left on each while replicas are placed."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from opml_common.errors import FailedPrecondition, NotFound
from opml_inference_router.placement.fleet_config import LOCAL_SITE, FleetConfig, ModelVersion, PoolKind


@dataclass(frozen=True)
class Worker:
    """One machine (or accelerator card) of a pool; ``id`` is ``{pool}-{index:03d}``."""

    id: str
    pool: str
    kind: PoolKind
    site: str = LOCAL_SITE


class Fleet:
    """Every worker of every pool, in pool order then index order (the order first-fit scans)."""

    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        self.kinds: Mapping[str, PoolKind] = {kind.name: kind for kind in config.pool_kinds}
        self.workers: tuple[Worker, ...] = tuple(
            Worker(f"{pool.name}-{index:03d}", pool.name, self.kinds[pool.kind], pool.site)
            for pool in config.pools
            for index in range(pool.workers)
        )
        self._by_id = {worker.id: worker for worker in self.workers}

    def worker(self, worker_id: str) -> Worker:
        """Raises: NotFound when no worker has that id."""
        try:
            return self._by_id[worker_id]
        except KeyError:
            raise NotFound(f"worker {worker_id!r} is not in the fleet") from None

    def workers_of(self, kind: str) -> tuple[Worker, ...]:
        return tuple(worker for worker in self.workers if worker.kind.name == kind)


@dataclass(frozen=True)
class WorkerRoom:
    """A worker and what is still free on it: what a policy ranks when it picks workers."""

    worker: Worker
    free_slots: int
    free_memory_mib: float


class Occupancy:
    """Slots and memory in use on each worker, and the model versions each hosts.

    The planner fills one while it places replicas, and the move planner replays actions on one,
    so neither can put more on a worker than its kind declares.
    """

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self._slots: Counter[str] = Counter()
        self._memory: Counter[str] = Counter()
        self._hosted: dict[str, Counter[ModelVersion]] = {worker.id: Counter() for worker in fleet.workers}

    def fits(self, worker_id: str, memory_mib: float) -> bool:
        """Whether one more replica of ``memory_mib`` fits on the worker."""
        kind = self.fleet.worker(worker_id).kind
        return self._slots[worker_id] < kind.slots and self._memory[worker_id] + memory_mib <= kind.memory_mib + 1e-9

    def add(self, worker_id: str, model: ModelVersion, memory_mib: float) -> None:
        """Raises: FailedPrecondition when the replica does not fit; NotFound for an unknown worker."""
        if not self.fits(worker_id, memory_mib):
            kind = self.fleet.worker(worker_id).kind
            raise FailedPrecondition(
                f"{model} ({memory_mib:.0f} MiB) does not fit on worker {worker_id}: "
                f"{self._slots[worker_id]}/{kind.slots} slots and "
                f"{self._memory[worker_id]:.0f}/{kind.memory_mib} MiB in use"
            )
        self._slots[worker_id] += 1
        self._memory[worker_id] += memory_mib
        self._hosted[worker_id][model] += 1

    def remove(self, worker_id: str, model: ModelVersion, memory_mib: float) -> None:
        """Raises: FailedPrecondition when the worker hosts no replica of ``model``."""
        if self._hosted[worker_id][model] <= 0:
            raise FailedPrecondition(f"worker {worker_id} hosts no replica of {model}")
        self._slots[worker_id] -= 1
        self._memory[worker_id] -= memory_mib
        self._hosted[worker_id][model] -= 1

    def rooms(self, kind: str, memory_mib: float, model: ModelVersion, *, per_worker: int = 1) -> list[WorkerRoom]:
        """Workers of ``kind`` with room for one more replica of ``model`` (``memory_mib``), in fleet
        order, leaving out those that already host ``per_worker`` replicas of it."""
        return [
            WorkerRoom(worker, worker.kind.slots - self._slots[worker.id],
                       worker.kind.memory_mib - self._memory[worker.id])
            for worker in self.fleet.workers
            if worker.kind.name == kind and self.fits(worker.id, memory_mib)
            and self._hosted[worker.id][model] < per_worker
        ]
