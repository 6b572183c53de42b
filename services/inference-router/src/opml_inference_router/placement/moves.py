"""Capacity-safe moves: the ordered actions that take the fleet from one plan to another.

A model version's *capacity* is the rate its ready replicas take within its SLO (each replica
counts its option's ``replica_capacity_rps``). Moving from plan A to plan B never lets a model's
ready capacity fall below ``min(capacity in A, capacity in B)``: new replicas are added and waited
for before old ones go, and no worker ever holds more than its kind's slots and memory. When every
target worker is full of replicas that cannot go yet, one of them is first copied to a worker with
room (a temporary replica, removed at the end), which frees its place without a gap.

A replica that keeps its model version, worker and precision but changes its batch cap or its
session options is re-sized in place (:class:`ResizeReplica`): the worker keeps the loaded session
and only its batcher's cap changes, or builds the version's sessions with the new options and swaps
them in once built, so it needs no free slot and never stops serving (a full single-slot accelerator
can be re-sized).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace

from opml_common.errors import FailedPrecondition, OpmlError
from opml_inference_router.placement.fleet import Fleet, Occupancy
from opml_inference_router.placement.fleet_config import ModelVersion
from opml_inference_router.placement.plan import Plan, SessionChoice

_EPSILON = 1e-9


@dataclass(frozen=True, order=True)
class Replica:
    """One replica: a model version on a worker (``index`` tells apart replicas of one model on one
    worker), with the settings it was loaded with (precision, batch cap, session options)."""

    model: ModelVersion
    worker: str
    index: int
    pool_kind: str
    precision: str
    max_batch: int
    memory_mib: float = field(compare=False)
    capacity_rps: float = field(compare=False)
    session: SessionChoice = SessionChoice()


@dataclass(frozen=True)
class AddReplica:
    """Start loading ``replica`` on its worker (it takes its slot and memory from now on)."""

    replica: Replica


@dataclass(frozen=True)
class WaitReady:
    """Wait until every one of ``replicas`` reports ready; only then do they count as capacity."""

    replicas: tuple[Replica, ...]


@dataclass(frozen=True)
class RemoveReplica:
    """Drain and unload ``replica``."""

    replica: Replica


@dataclass(frozen=True)
class ResizeReplica:
    """Change the ready replica ``old`` into ``new`` in place: same model version, worker, index and
    precision, another batch cap or session options (and so capacity and memory). It keeps serving
    throughout: a new batch cap re-caps the batcher; new session options build the new sessions
    beside the serving ones, which go once the new serve (the worker's reload of a version)."""

    old: Replica
    new: Replica


Action = AddReplica | WaitReady | ResizeReplica | RemoveReplica


def _place(replica: Replica) -> tuple:
    """What a re-size in place keeps: the loaded session (model version, precision) and where it runs."""
    return replica.model, replica.worker, replica.index, replica.pool_kind, replica.precision


def replicas_of(plan: Plan) -> list[Replica]:
    """Every replica a plan runs, sorted."""
    seen: Counter[tuple[ModelVersion, str]] = Counter()
    replicas = []
    for replica_set, worker_id in plan.replicas():
        option = replica_set.option
        replicas.append(Replica(replica_set.model, worker_id, seen[replica_set.model, worker_id], option.pool_kind,
                                option.precision, option.max_batch, option.memory_mib, option.replica_capacity_rps,
                                option.session))
        seen[replica_set.model, worker_id] += 1
    return sorted(replicas)


def _capacities(replicas: list[Replica]) -> dict[ModelVersion, float]:
    capacity: dict[ModelVersion, float] = defaultdict(float)
    for replica in replicas:
        capacity[replica.model] += replica.capacity_rps
    return capacity


def _floors(current: list[Replica], target: list[Replica]) -> dict[ModelVersion, float]:
    before, after = _capacities(current), _capacities(target)
    return {model: min(before.get(model, 0.0), after.get(model, 0.0)) for model in set(before) | set(after)}


def plan_moves(current: Plan, target: Plan, fleet: Fleet) -> tuple[Action, ...]:
    """The actions that turn ``current`` into ``target`` without ever dropping a model's capacity
    below ``min(before, after)`` or overfilling a worker. Replicas both plans share stay untouched;
    one whose batch cap alone changes is re-sized in place.

    Each round adds every new replica that fits now and waits for them together, re-sizes those
    whose model keeps enough ready capacity (capacity gains first), then removes every old replica
    whose model keeps enough ready capacity without it.

    Raises:
        FailedPrecondition: the move is blocked and no worker has room for a temporary replica.
    """
    before, after = replicas_of(current), replicas_of(target)
    floors = _floors(before, after)
    ready = _capacities(before)
    occupancy = Occupancy(fleet)
    for replica in before:
        occupancy.add(replica.worker, replica.model, replica.memory_mib)
    kept = set(before) & set(after)
    adds = [replica for replica in after if replica not in kept]
    removes = [replica for replica in before if replica not in kept]
    resizes = _pair_resizes(adds, removes)
    temporary: set[Replica] = set()
    actions: list[Action] = []
    while adds or removes or resizes:
        started = []
        for replica in list(adds):
            if occupancy.fits(replica.worker, replica.memory_mib):
                occupancy.add(replica.worker, replica.model, replica.memory_mib)
                actions.append(AddReplica(replica))
                started.append(replica)
                adds.remove(replica)
        if started:
            actions.append(WaitReady(tuple(started)))
            for replica in started:
                ready[replica.model] += replica.capacity_rps
        resized = False
        for old, new in sorted(resizes, key=lambda pair: pair[0].capacity_rps - pair[1].capacity_rps):
            left = ready[old.model] - old.capacity_rps + new.capacity_rps
            if left >= floors[old.model] - _EPSILON and _resize(occupancy, old, new):
                ready[old.model] = left
                actions.append(ResizeReplica(old, new))
                resizes.remove((old, new))
                resized = True
        removed = False
        for replica in list(removes):
            if ready[replica.model] - replica.capacity_rps >= floors[replica.model] - _EPSILON:
                occupancy.remove(replica.worker, replica.model, replica.memory_mib)
                ready[replica.model] -= replica.capacity_rps
                actions.append(RemoveReplica(replica))
                removes.remove(replica)
                removed = True
        if not started and not removed and not resized:
            if not adds and not removes:
                old, new = resizes[0]
                raise FailedPrecondition(f"cannot re-size {old.model} on {old.worker} in place: its new size "
                                         f"({new.memory_mib:.0f} MiB) does not fit in the worker's memory")
            stand_in = _stage(adds, removes, temporary, occupancy)
            occupancy.add(stand_in.worker, stand_in.model, stand_in.memory_mib)
            actions += [AddReplica(stand_in), WaitReady((stand_in,))]
            ready[stand_in.model] += stand_in.capacity_rps
            removes.append(stand_in)
            temporary.add(stand_in)
    return tuple(actions)


def _pair_resizes(adds: list[Replica], removes: list[Replica]) -> list[tuple[Replica, Replica]]:
    """Takes out of ``adds`` and ``removes`` the (old, new) pairs that differ in their batch cap or
    session options only."""
    new_at = {_place(replica): replica for replica in adds}
    pairs = []
    for old in list(removes):
        new = new_at.pop(_place(old), None)
        if new is not None:
            removes.remove(old)
            adds.remove(new)
            pairs.append((old, new))
    return pairs


def _resize(occupancy: Occupancy, old: Replica, new: Replica) -> bool:
    """Swaps ``old``'s memory for ``new``'s on their worker when it fits (the slot stays taken)."""
    occupancy.remove(old.worker, old.model, old.memory_mib)
    if occupancy.fits(new.worker, new.memory_mib):
        occupancy.add(new.worker, new.model, new.memory_mib)
        return True
    occupancy.add(old.worker, old.model, old.memory_mib)
    return False


def _stage(adds: list[Replica], removes: list[Replica], temporary: set[Replica], occupancy: Occupancy) -> Replica:
    """A temporary copy, on a worker with room, of an old replica that sits where a new one must go."""
    blocked_workers = {replica.worker for replica in adds}
    targets = {(replica.model, replica.worker) for replica in adds}
    for old in removes:
        if old in temporary or old.worker not in blocked_workers:
            continue
        rooms = [room for room in occupancy.rooms(old.pool_kind, old.memory_mib, old.model)
                 if (old.model, room.worker.id) not in targets]
        if rooms:
            best = min(rooms, key=lambda room: (room.worker.id in blocked_workers, -room.free_slots))
            return replace(old, worker=best.worker.id, index=0)
    raise FailedPrecondition(
        f"cannot reach the new plan without dropping capacity: new replicas wait for room on "
        f"{', '.join(sorted(blocked_workers))}, whose old replicas cannot go yet, and no worker has room "
        f"for a temporary copy of one of them; free a slot or add a worker"
    )


def check_moves(current: Plan, target: Plan, actions: tuple[Action, ...], fleet: Fleet) -> None:
    """Replays ``actions`` from ``current`` and checks every step: no worker over its slots or memory,
    replicas waited for before they count, re-sizes only of a ready replica into the same loaded one,
    no model below ``min(capacity before, after)``, and
    ``target`` reached at the end. The executor runs this before it acts.

    Raises:
        FailedPrecondition: naming the first step that breaks a rule, or the replicas that differ at the end.
    """
    before, after = replicas_of(current), replicas_of(target)
    floors = _floors(before, after)
    ready = _capacities(before)
    occupancy = Occupancy(fleet)
    present, loading = set(before), set()
    for replica in before:
        occupancy.add(replica.worker, replica.model, replica.memory_mib)
    for step, action in enumerate(actions):
        try:
            if isinstance(action, AddReplica):
                if action.replica in present:
                    raise FailedPrecondition(f"{action.replica} is already there")
                occupancy.add(action.replica.worker, action.replica.model, action.replica.memory_mib)
                present.add(action.replica)
                loading.add(action.replica)
            elif isinstance(action, WaitReady):
                for replica in action.replicas:
                    if replica not in loading:
                        raise FailedPrecondition(f"waits for {replica}, which is not loading")
                    loading.remove(replica)
                    ready[replica.model] += replica.capacity_rps
            elif isinstance(action, ResizeReplica):
                old, new = action.old, action.new
                if _place(old) != _place(new):
                    raise FailedPrecondition(f"re-sizes {old} into {new}, which is not the same loaded replica")
                if old not in present or old in loading:
                    raise FailedPrecondition(f"re-sizes {old}, which is not a ready replica")
                left = ready[old.model] - old.capacity_rps + new.capacity_rps
                if left < floors.get(old.model, 0.0) - _EPSILON:
                    raise FailedPrecondition(f"re-sizing {old} leaves {old.model} {left:.1f} rps of ready "
                                             f"capacity, below {floors[old.model]:.1f} rps")
                occupancy.remove(old.worker, old.model, old.memory_mib)
                occupancy.add(new.worker, new.model, new.memory_mib)
                present.remove(old)
                present.add(new)
                ready[old.model] = left
            else:
                replica = action.replica
                if replica not in present or replica in loading:
                    raise FailedPrecondition(f"removes {replica}, which is not a ready replica")
                left = ready[replica.model] - replica.capacity_rps
                if left < floors.get(replica.model, 0.0) - _EPSILON:
                    raise FailedPrecondition(f"removing {replica} leaves {replica.model} {left:.1f} rps of ready "
                                             f"capacity, below {floors[replica.model]:.1f} rps")
                occupancy.remove(replica.worker, replica.model, replica.memory_mib)
                present.remove(replica)
                ready[replica.model] = left
        except OpmlError as error:
            raise FailedPrecondition(f"step {step} ({type(action).__name__}): {error.message}") from None
    if loading or present != set(after):
        missing, extra = sorted(set(after) - present), sorted(present - set(after))
        raise FailedPrecondition(f"the moves end with replicas still loading ({len(loading)}), "
                                 f"missing {missing[:3]} ({len(missing)}) and extra {extra[:3]} ({len(extra)})")
