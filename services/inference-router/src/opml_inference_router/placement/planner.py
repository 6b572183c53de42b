"""The planner (DLIS's "model master"): places model versions on the fleet with a policy, and
re-places those whose measured load or latency departs from the plan, with capacity-safe moves.

Transport-free: the deploy API, the profiler and the serving metrics feed it dataclasses, and
the executor that loads replicas on workers consumes its actions.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass

from opml_common.errors import InvalidArgument, OpmlError
from opml_inference_router.placement.fleet import Fleet, Occupancy
from opml_inference_router.placement.fleet_config import ModelVersion
from opml_inference_router.placement.latency import (
    Batching,
    BatchQueueModel,
    LatencyModel,
    ServiceCurve,
    calibration_factor,
)
from opml_inference_router.placement.moves import Action, plan_moves
from opml_inference_router.placement.plan import ModelDemand, Option, Plan, ReplicaSet, SessionChoice
from opml_inference_router.placement.policy import PlacementPolicy
from opml_inference_router.placement.predicted import ProfilePredictor
from opml_inference_router.placement.profile import Profile, ProfileBook
from opml_inference_router.placement.serving import ServingConfigChooser
from opml_inference_router.placement.sites import WorkerCheck


class Planner:
    """Runs a placement policy over a fleet and enforces what no policy may break: a model only on
    kinds it allows and that can host it, replicas within each worker's slots and memory, and the
    replicas of one model version spread over as many workers as possible (distinct workers
    while there are enough, so losing a worker loses at most one replica of each model), and at
    least :meth:`min_replicas` of them on distinct workers while the kind has workers with room
    (N+1: one worker lost, a replica still serves); where fewer fit, as many as fit, down to what
    the policy's option asked for.

    With a ``predictor``, a model version is also placed on kinds it lacks a full profile on, by
    the profile the predictor transfers from another kind (:mod:`.predicted`); without one, such a
    kind is "not profiled". With a ``chooser``, each option's replicas load with the serving
    configuration (session options, precision) the chooser predicts best on its kind, and the
    policy sizes the option on the profile that configuration is predicted to have (:mod:`.serving`);
    without one, with the worker's defaults.

    With ``usable`` (:data:`~.sites.WorkerCheck`), a worker it gives a reason against (its host is
    lost, its site's link cannot carry the model: :mod:`.sites`) gets no replica of that model.

    A version whose config has ``instance_groups`` is placed as those groups say (every group, each
    its count, before the sized versions), not on one kind the policy chooses: :meth:`_place_groups`."""

    def __init__(self, *, fleet: Fleet, policy: PlacementPolicy, predictor: ProfilePredictor | None = None,
                 chooser: ServingConfigChooser | None = None, usable: WorkerCheck | None = None) -> None:
        self.fleet = fleet
        self.policy = policy
        self.predictor = predictor
        self.chooser = chooser
        self.usable = usable

    def refusals(self, demand: ModelDemand) -> dict[str, str]:
        """The workers ``usable`` keeps the demand off, each with the reason (none without ``usable``)."""
        if self.usable is None:
            return {}
        reasons = {worker.id: self.usable(demand, worker) for worker in self.fleet.workers}
        return {worker: reason for worker, reason in reasons.items() if reason}

    def min_replicas(self, demand: ModelDemand) -> int:
        """The replica floor of a demand: its config's ``min_replicas``, else the fleet's."""
        configured = demand.config.min_replicas
        return configured if configured is not None else self.fleet.config.min_replicas

    def _floored(self, demand: ModelDemand, option: Option) -> Iterator[Option]:
        """``option`` raised to the demand's replica floor (capped at the kind's workers, so the
        replicas stay on distinct workers), then with one replica fewer at a time down to the option's
        own count (included last): the sizes to try, most replicas first."""
        floor = min(self.min_replicas(demand), len(self.fleet.workers_of(option.pool_kind)))
        for replicas in range(max(floor, option.replicas), option.replicas, -1):
            yield dataclasses.replace(option, replicas=replicas,
                                      cost_per_hour=option.cost_per_hour / option.replicas * replicas)
        yield option

    def plan(self, demands: Sequence[ModelDemand], profiles: ProfileBook, *,
             current: Plan | None = None, keep: Collection[ModelVersion] = ()) -> Plan:
        """Places every demand; those that cannot be placed are in ``Plan.unplaced`` with the reason.

        ``keep`` names model versions whose replica set in ``current`` stays exactly as it is (it
        claims its workers first). The others are placed afresh; the policy is told where they run
        in ``current`` so it can leave them there.

        Raises:
            InvalidArgument: a model version is demanded twice; a model allows a pool kind the
                fleet does not declare; ``keep`` names a model version ``current`` does not place
                or no demand asks for.
        """
        by_model = self._index(demands)
        occupancy = Occupancy(self.fleet)
        placements: dict[ModelVersion, ReplicaSet] = {}
        for model in keep:
            if current is None or model not in current.placements:
                raise InvalidArgument("keep", f"{model} is not placed in the current plan, so it cannot be kept")
            if model not in by_model:
                raise InvalidArgument("keep", f"{model} is not among the demands, so it cannot be kept")
            replica_set = current.placements[model]
            for part in replica_set.parts():
                for worker_id in part.workers:
                    occupancy.add(worker_id, model, part.option.memory_mib)
            placements[model] = replica_set

        if self.predictor is not None:
            profiles, _ = self.predictor.complete([d for m, d in by_model.items() if m not in placements], profiles)
        usable: dict[ModelVersion, dict[str, Profile]] = {}
        rejected: dict[ModelVersion, dict[str, str]] = {}
        options = {}
        unplaced: dict[ModelVersion, str] = {}
        for model, demand in by_model.items():  # exactly the groups a config asks for, before any sized placement
            if model in placements or demand.config.instance_groups is None:
                continue
            now = current.placements.get(model) if current is not None else None
            grouped = self._place_groups(demand, profiles, occupancy, now)
            if isinstance(grouped, ReplicaSet):
                placements[model] = grouped
            else:
                unplaced[model] = grouped
        for model, demand in by_model.items():
            if model in placements or model in unplaced:
                continue
            usable[model], rejected[model] = self._screen(demand, profiles)
            now = current.placements.get(model) if current is not None else None
            sessions = self._choose(demand, usable[model], now)
            options[model] = [dataclasses.replace(option, session=sessions[option.pool_kind])
                              if option.pool_kind in sessions else option
                              for option in self.policy.options(demand, usable[model], self.fleet)]
        order = self.policy.order(options)
        if sorted(order) != sorted(options):
            raise OpmlError(f"{type(self.policy).__name__}.order must return every model version to place exactly once")

        barred = {model: frozenset(self.refusals(by_model[model])) for model in order}
        for model in order:
            demand = by_model[model]
            if not options[model]:
                unplaced[model] = self._why_no_option(demand, usable[model], rejected[model])
                continue
            now = current.placements.get(model) if current is not None else None
            for option in options[model]:
                same_kind = now is not None and now.option.pool_kind == option.pool_kind
                workers = self._claim(occupancy, model, option, frozenset(now.workers) if same_kind else frozenset(),
                                      barred[model])
                if workers is not None:
                    placements[model] = ReplicaSet(model, option, workers, demand.rate_rps)
                    break
            else:
                needs = "; ".join(f"{o.replicas} x {o.memory_mib:.0f} MiB on {o.pool_kind}" for o in options[model])
                unplaced[model] = f"no room for any option the policy offered ({needs})"
        # N+1 with what is left once every model has what its load needs (a floor never costs another model
        # its placement): each placed version, in the same order, grows to its floor on distinct workers.
        for model in order:
            placed = placements.get(model)
            if placed is None or model in keep or by_model[model].config.instance_groups is not None:
                continue
            now = current.placements.get(model) if current is not None else None
            ran = frozenset(now.workers) if now is not None and now.option.pool_kind == placed.option.pool_kind \
                else frozenset()  # where it ran before also ranks first: a re-placed version grows back there
            for option in self._floored(by_model[model], placed.option):
                if option.replicas <= len(placed.workers):
                    break
                for worker_id in placed.workers:
                    occupancy.remove(worker_id, model, placed.option.memory_mib)
                workers = self._claim(occupancy, model, option, frozenset(placed.workers) | ran, barred[model])
                if workers is not None:
                    placements[model] = ReplicaSet(model, option, workers, placed.rate_rps)
                    break
                for worker_id in placed.workers:  # it does not fit: back as it was
                    occupancy.add(worker_id, model, placed.option.memory_mib)
        return Plan(placements, unplaced)

    def _place_groups(self, demand: ModelDemand, profiles: ProfileBook, occupancy: Occupancy,
                      now: ReplicaSet | None) -> ReplicaSet | str:
        """The version's ``instance_groups`` placed as they are (one replica set each, the first holding the
        others as its ``groups``), each on as many distinct usable workers of its kind as have room, up to its
        count; what does not fit is named in ``short``. The reason when no group can be placed at all.

        Each group is sized (batch cap, capacity) by the policy for its share of the rate (count over the
        groups' total) on the kind's profile (taken in the precision the worker chose, which may be another
        than the group's: its measured latency then corrects the routing); its replica count stays the group's
        and its replicas load in the group's precision."""
        groups = demand.config.instance_groups or ()
        usable, rejected = self._screen(demand, profiles)
        sessions = self._choose(demand, usable, now)
        barred = frozenset(self.refusals(demand))
        total = sum(group.count for group in groups)
        parts: list[ReplicaSet] = []
        notes: list[str] = []
        for group in groups:
            name = f"{group.pool_kind}/{group.precision}"
            profile = usable.get(group.pool_kind)
            if profile is None:
                notes.append(f"{name}: 0 of {group.count} ({rejected.get(group.pool_kind, 'not usable')})")
                continue
            share = ModelDemand(demand.config, demand.version, demand.rate_rps * group.count / total)
            sized = [o for o in self.policy.options(share, {group.pool_kind: profile}, self.fleet)
                     if o.pool_kind == group.pool_kind]
            if not sized:
                notes.append(f"{name}: 0 of {group.count} (no batch cap meets p99 <= {demand.config.slo.p99_ms} ms "
                             f"at {share.rate_rps:g} rps)")
                continue
            option = dataclasses.replace(sized[0], precision=group.precision)
            if group.pool_kind in sessions:
                option = dataclasses.replace(option, session=sessions[group.pool_kind])
            ran = frozenset(w for part in (now.parts() if now is not None else ()) for w in part.workers
                            if (part.option.pool_kind, part.option.precision) == (group.pool_kind, group.precision))
            for count in range(group.count, 0, -1):
                counted = dataclasses.replace(option, replicas=count,
                                              cost_per_hour=option.cost_per_hour / option.replicas * count)
                workers = self._claim(occupancy, demand.model, counted, ran, barred)
                if workers is not None:
                    parts.append(ReplicaSet(demand.model, counted, workers, share.rate_rps))
                    if count < group.count:
                        notes.append(f"{name}: {count} of {group.count} (the usable workers have no room for the rest)")
                    break
            else:
                notes.append(f"{name}: 0 of {group.count} (no usable {group.pool_kind} worker has room)")
        if not parts:
            return "no instance group can be placed (" + "; ".join(notes) + ")"
        short = "instance groups short: " + "; ".join(notes) if notes else ""
        return dataclasses.replace(parts[0], short=short, groups=tuple(parts[1:]))

    def _choose(self, demand: ModelDemand, usable: dict[str, Profile], now: ReplicaSet | None) -> dict:
        """Each usable kind's chosen session options; ``usable``'s profiles become those the chosen
        configurations are predicted to have (nothing without a chooser)."""
        if self.chooser is None:
            return {}
        sessions = {}
        for name, profile in list(usable.items()):
            incumbent = now.option if now is not None and now.option.pool_kind == name else None
            usable[name], sessions[name] = self.chooser.choose(demand, self.fleet.kinds[name], profile, incumbent)
        return sessions

    def _claim(self, occupancy: Occupancy, model: ModelVersion, option: Option,
               current: frozenset[str], barred: frozenset[str] = frozenset()) -> tuple[str, ...] | None:
        """Takes workers for the option's replicas in ``occupancy`` (nothing when they do not all fit).

        Replicas of a model spread over as many workers as possible: at most one per worker while
        the kind has enough workers, else at most ``ceil(replicas / workers)`` on each.
        """
        per_worker = math.ceil(option.replicas / len(self.fleet.workers_of(option.pool_kind)))
        chosen: list[str] = []
        while len(chosen) < option.replicas:
            rooms = [room for room in occupancy.rooms(option.pool_kind, option.memory_mib, model, per_worker=per_worker)
                     if room.worker.id not in barred]
            if not rooms:
                break
            ranked = self.policy.rank_workers(option, rooms, current)
            if sorted(room.worker.id for room in ranked) != sorted(room.worker.id for room in rooms):
                raise OpmlError(
                    f"{type(self.policy).__name__}.rank_workers must return the rooms it was given, each once"
                )
            for room in ranked[: option.replicas - len(chosen)]:
                occupancy.add(room.worker.id, model, option.memory_mib)
                chosen.append(room.worker.id)
        if len(chosen) < option.replicas:
            for worker_id in chosen:
                occupancy.remove(worker_id, model, option.memory_mib)
            return None
        return tuple(chosen)

    def _index(self, demands: Sequence[ModelDemand]) -> dict[ModelVersion, ModelDemand]:
        by_model: dict[ModelVersion, ModelDemand] = {}
        for index, demand in enumerate(demands):
            if demand.model in by_model:
                raise InvalidArgument(f"demands[{index}]", f"{demand.model} is demanded twice")
            for position, kind in enumerate(demand.config.pool_kinds):
                if kind not in self.fleet.kinds:
                    raise InvalidArgument(
                        f"demands[{index}].config.pool_kinds[{position}]",
                        f"must be a pool kind the fleet declares ({', '.join(self.fleet.kinds)}), but got {kind!r}",
                    )
            for position, group in enumerate(demand.config.instance_groups or ()):
                kind = self.fleet.kinds.get(group.pool_kind)
                if kind is not None and group.precision not in kind.precisions:
                    raise InvalidArgument(
                        f"demands[{index}].config.instance_groups[{position}].precision",
                        f"must be a precision pool kind {kind.name} runs ({', '.join(kind.precisions)}), "
                        f"but got {group.precision!r}",
                    )
            by_model[demand.model] = demand
        return by_model

    def _screen(self, demand: ModelDemand, profiles: ProfileBook) -> tuple[dict[str, Profile], dict[str, str]]:
        """The kinds that can host the model (with their profiles), and why each other allowed kind cannot."""
        usable, rejected = {}, {}
        refusals = self.refusals(demand)
        for name in demand.config.pool_kinds:
            kind, profile = self.fleet.kinds[name], profiles.get(demand.model, name)
            workers = self.fleet.workers_of(name)
            if not workers:
                rejected[name] = "the fleet has no workers of this kind"
            elif all(worker.id in refusals for worker in workers):
                rejected[name] = "; ".join(f"{worker.id}: {refusals[worker.id]}" for worker in workers)
            elif profile is None:
                rejected[name] = "not profiled"
            elif profile.precision not in kind.precisions:
                rejected[name] = (f"profiled in {profile.precision}, which the kind does not run "
                                  f"({', '.join(kind.precisions)})")
            elif profile.precision not in demand.config.precisions:
                rejected[name] = (f"runs {profile.precision}, which the model does not allow "
                                  f"({', '.join(demand.config.precisions)})")
            elif profile.memory_mib > kind.memory_mib:
                rejected[name] = f"a replica needs {profile.memory_mib:.0f} MiB, a worker has {kind.memory_mib} MiB"
            else:
                usable[name] = profile
        return usable, rejected

    @staticmethod
    def _why_no_option(demand: ModelDemand, usable: Mapping[str, Profile], rejected: Mapping[str, str]) -> str:
        reasons = [f"{name}: {reason}" for name, reason in rejected.items()]
        reasons += [f"{name}: no replica set meets p99 <= {demand.config.slo.p99_ms} ms at {demand.rate_rps:g} rps"
                    for name in usable]
        return "no pool kind can serve it (" + "; ".join(reasons) + ")"


@dataclass(frozen=True)
class Observation:
    """What serving measured for one model version over the last window."""

    rate_rps: float
    p99_ms: float


@dataclass(frozen=True)
class Replan:
    """A re-placement: the new plan, the moves that reach it, why each model version was re-placed,
    and the profiles with the calibrations learnt from measurements (to be stored)."""

    plan: Plan
    moves: tuple[Action, ...]
    reasons: Mapping[ModelVersion, str]
    profiles: ProfileBook


class Replanner:
    """Re-places the model versions whose measured load or latency departs from the plan.

    A model version is re-placed when its measured rate is off the planned rate by more than
    ``rate_tolerance`` (down only if it runs more than one replica) or its measured p99 is above
    its SLO. Whenever the measured p99 is above the SLO or above what the latency model predicts
    at the measured rate by more than ``latency_tolerance``, its profile is scaled until the model
    predicts the measurement, so later sizing uses what serving showed; a slower-than-profiled
    model still within its SLO keeps its replicas (no churn for a harmless error). New demands are
    placed, dropped ones removed, unplaced ones retried; everything else stays. A model version
    that no longer fits anywhere keeps its current replicas, except those on workers ``usable``
    refuses (a lost host's): it is reduced to the replicas on the others, marked
    :attr:`ReplicaSet.short`, and unplaced when none is left, so no replica stays named on a dead
    worker. ``regrow`` (a worker came back or joined) grows the short versions and those below their
    replica floor where room is now, their lost workers first, without moving the replicas they run.
    A version with instance groups is not resized by its measurements (its counts are its config's): it
    is re-placed within its groups when a worker it runs on is refused, and with ``regrow`` while short.
    """

    def __init__(self, *, planner: Planner, latency_model: LatencyModel | None = None,
                 rate_tolerance: float = 0.25, latency_tolerance: float = 0.25) -> None:
        """Raises: InvalidArgument when a tolerance is not in (0, 1]."""
        for name, value in (("rate_tolerance", rate_tolerance), ("latency_tolerance", latency_tolerance)):
            if not 0 < value <= 1:
                raise InvalidArgument(name, f"must be in (0, 1], but got {value}")
        self.planner = planner
        self.latency_model = latency_model or BatchQueueModel()
        self.rate_tolerance = rate_tolerance
        self.latency_tolerance = latency_tolerance

    def replan(self, plan: Plan, demands: Sequence[ModelDemand], profiles: ProfileBook,
               observations: Mapping[ModelVersion, Observation], *, regrow: bool = False) -> Replan:
        """Raises: InvalidArgument as :meth:`Planner.plan`; FailedPrecondition as
        :func:`~opml_inference_router.placement.moves.plan_moves`."""
        calibrated = ProfileBook(profiles)
        reasons: dict[ModelVersion, str] = {}
        refreshed: dict[ModelVersion, SessionChoice] = {}  # kept configurations, chosen again for a new reason
        updated: list[ModelDemand] = []
        refused: dict[ModelVersion, dict[str, str]] = {}  # placed versions' refused workers, with the reasons
        for demand in demands:
            model = demand.model
            placed, seen = plan.placements.get(model), observations.get(model)
            if placed is None:
                reasons[model] = "was not placed" if model in plan.unplaced else "new"
                updated.append(demand)
                continue
            refusals = self.planner.refusals(demand)
            refused[model] = {worker: refusals[worker] for worker in placed.all_workers if worker in refusals}
            if demand.config.instance_groups is not None:  # its groups' counts are exact: re-placed only to keep them
                if refused[model]:
                    reasons[model] = "; ".join(f"{worker}: {why}" for worker, why in refused[model].items())
                elif regrow and placed.short:
                    reasons[model] = placed.short
                updated.append(demand)
                continue
            if refused[model]:
                reasons[model] = "; ".join(f"{worker}: {why}" for worker, why in refused[model].items())
                updated.append(demand)
                continue
            if seen is None:
                reason = self._configuration_drift(demand, placed, calibrated, refreshed)
                if reason:
                    reasons[model] = reason
                updated.append(demand)
                continue
            reason = self._drift(demand, placed, seen, calibrated) or self._configuration_drift(
                demand, placed, calibrated, refreshed)
            if reason:
                reasons[model] = reason
                updated.append(ModelDemand(demand.config, demand.version, seen.rate_rps))
            else:
                updated.append(demand)
        demanded = {demand.model for demand in demands}
        for model in plan.placements:
            if model not in demanded:
                reasons[model] = "no longer demanded"
        keep = {model for model in plan.placements if model in demanded and model not in reasons}
        grouped = {demand.model for demand in demands if demand.config.instance_groups is not None}
        current, dropped = plan, set()
        target = self.planner.plan(updated, calibrated, current=current, keep=keep)
        while stuck := {model for model in target.unplaced if model in plan.placements and model not in dropped}:
            # Serving something beats serving nothing: it keeps its replicas on the workers it may still use,
            # and the rest is re-planned around them.
            kept = dict(current.placements)
            for model in stuck:
                placed, why = plan.placements[model], target.unplaced[model]
                live = tuple(worker for worker in placed.workers if worker not in refused.get(model, {}))
                if not live or placed.groups or model in grouped:  # none left to keep (groups: none fits anywhere)
                    reasons[model] += f"; unplaced: {why}"
                    dropped.add(model)
                    continue
                reasons[model] += f"; kept where it is: {why}" if len(live) == len(placed.workers) else \
                    f"; reduced to its {len(live)} replicas on usable workers: {why}"
                kept[model] = self._resized(placed, live, short=why) if len(live) < len(placed.workers) else placed
                keep.add(model)
            current = Plan(kept, plan.unplaced)
            target = self.planner.plan(updated, calibrated, current=current, keep=keep)
        target = Plan({model: placed if model in grouped else  # the planner says what its groups run short of
                       self._annotated(plan, model, placed, refreshed if model not in reasons else {},
                                       refused.get(model, {}))
                       for model, placed in target.placements.items()}, target.unplaced)
        if regrow:
            target = self._grown(target, updated, reasons)
        for model, placed in target.placements.items():
            if model in reasons and self.planner.chooser is not None:
                reasons[model] += "".join(f"; serves with {part.option.session}, {part.option.precision} on "
                                          f"{part.option.pool_kind} ({part.option.session.basis})"
                                          for part in placed.parts())
        return Replan(target, plan_moves(plan, target, self.planner.fleet), reasons, calibrated)

    @staticmethod
    def _resized(placed: ReplicaSet, workers: tuple[str, ...], **changes) -> ReplicaSet:
        """``placed`` on ``workers`` (one replica each, as before), costed for those."""
        option = dataclasses.replace(placed.option, replicas=len(workers),
                                     cost_per_hour=placed.option.cost_per_hour / len(placed.workers) * len(workers))
        return dataclasses.replace(placed, option=option, workers=workers, **changes)

    def _grown(self, plan: Plan, demands: Sequence[ModelDemand], reasons: dict[ModelVersion, str]) -> Plan:
        """``plan`` with each of ``demands`` that runs short of replicas (lost with no room elsewhere, or
        below its floor) grown on the workers with room that placement may use, its lost workers first,
        up to what it ran before, or its floor; the replicas it runs stay where they are."""
        fleet = self.planner.fleet
        occupancy = Occupancy(fleet)
        for placed, worker_id in plan.replicas():
            occupancy.add(worker_id, placed.model, placed.option.memory_mib)
        placements = dict(plan.placements)
        for demand in demands:
            placed = placements.get(demand.model)
            if placed is None or demand.config.instance_groups is not None:  # groups grow back by re-placement
                continue
            kind = placed.option.pool_kind
            wanted = max(len(placed.workers) + len(placed.lost),
                         min(self.planner.min_replicas(demand), len(fleet.workers_of(kind))))
            if len(placed.workers) >= wanted:
                continue
            refused = self.planner.refusals(demand)
            rooms = [room for room in occupancy.rooms(kind, placed.option.memory_mib, demand.model)
                     if room.worker.id not in refused]
            ranked = sorted(self.planner.policy.rank_workers(placed.option, rooms, frozenset(placed.lost)),
                            key=lambda room: room.worker.id not in placed.lost)
            added = tuple(room.worker.id for room in ranked[:wanted - len(placed.workers)])
            if not added:
                continue
            for worker_id in added:
                occupancy.add(worker_id, demand.model, placed.option.memory_mib)
            lost = tuple(worker for worker in placed.lost if worker not in added)
            workers = placed.workers + added
            short = placed.short if lost and len(workers) < len(placed.workers) + len(placed.lost) else ""
            placements[demand.model] = self._resized(placed, workers, short=short, lost=lost if short else ())
            grown = f"{len(placed.workers)} replicas grown to {len(workers)} on {', '.join(added)}"
            reasons[demand.model] = f"{reasons[demand.model]}; {grown}" if demand.model in reasons else grown
        return Plan(placements, plan.unplaced)

    @staticmethod
    def _annotated(plan: Plan, model: ModelVersion, placed: ReplicaSet, refreshed: Mapping[ModelVersion, SessionChoice],
                   refused: Mapping[str, str]) -> ReplicaSet:
        """``placed`` with its renewed serving configuration (``refreshed``), and :attr:`ReplicaSet.short`
        and ``lost`` saying why it runs fewer replicas than before a worker it was on was refused, and
        which ('' and none once it runs as many again)."""
        if model in refreshed:
            placed = dataclasses.replace(placed, option=dataclasses.replace(placed.option, session=refreshed[model]))
        before = plan.placements.get(model)
        if before is None:
            return placed
        if refused and len(placed.workers) < len(before.workers):
            why = "; ".join(f"{worker}: {reason}" for worker, reason in refused.items())
            short = (f"{len(placed.workers)} of {len(before.workers)} replicas ({why}); the usable workers "
                     f"have no room for the rest")
            lost = tuple(worker for worker in refused if worker not in placed.workers)
        elif before.lost and len(placed.workers) < len(before.workers) + len(before.lost):  # short until it grows
            short, lost = before.short, before.lost
        else:
            short, lost = "", ()
        return dataclasses.replace(placed, short=short, lost=lost) if (short, lost) != (placed.short, placed.lost) \
            else placed

    def _configuration_drift(self, demand: ModelDemand, placed: ReplicaSet, profiles: ProfileBook,
                             refreshed: dict[ModelVersion, SessionChoice]) -> str:
        """Why ``placed`` must load with another serving configuration ('' when the chooser keeps
        its own, or the planner has none). A configuration kept for another reason than before (the
        defaults, now predicted best) goes in ``refreshed``: the same replicas, the new reason shown."""
        chooser, option = self.planner.chooser, placed.option
        profile = profiles.get(placed.model, option.pool_kind)
        if chooser is None or profile is None:
            return ""
        planned = ModelDemand(demand.config, demand.version, placed.rate_rps)
        chosen_profile, chosen = chooser.choose(planned, self.planner.fleet.kinds[option.pool_kind], profile,
                                                incumbent=option)
        if (chosen, chosen_profile.precision) == (option.session, option.precision):
            if chosen.basis != option.session.basis:
                refreshed[placed.model] = chosen
            return ""
        return f"serving configuration {chosen}, {chosen_profile.precision} chosen (was {option.session}, " \
               f"{option.precision})"

    def _drift(self, demand: ModelDemand, placed: ReplicaSet, seen: Observation, profiles: ProfileBook) -> str:
        """Why ``placed`` must be re-placed ('' when it need not); scales its profile in ``profiles``
        when its measured latency departs from the prediction."""
        reasons = []
        planned, option = placed.rate_rps, placed.option
        if seen.rate_rps > planned * (1 + self.rate_tolerance):
            reasons.append(f"rate {seen.rate_rps:g} rps is above the planned {planned:g} rps")
        elif seen.rate_rps < planned * (1 - self.rate_tolerance) and option.replicas > max(
                1, min(self.planner.min_replicas(demand), len(self.planner.fleet.workers_of(option.pool_kind)))):
            reasons.append(f"rate {seen.rate_rps:g} rps is below the planned {planned:g} rps")
        profile = profiles.get(placed.model, option.pool_kind)
        if profile is None:
            return "; ".join(reasons)
        service = ServiceCurve(profile, self.planner.fleet.kinds[option.pool_kind])
        batching = Batching(option.max_batch, option.queue_delay_ms)
        per_replica = seen.rate_rps / len(placed.workers)
        predicted = self.latency_model.p99_ms(service, batching, per_replica)
        slo = demand.config.slo.p99_ms
        if seen.p99_ms > slo or seen.p99_ms > predicted * (1 + self.latency_tolerance):
            factor = calibration_factor(self.latency_model, service, batching, per_replica, seen.p99_ms)
            profiles.add(profile.scaled(factor), replace=True)
            if seen.p99_ms > slo:
                reasons.append(f"p99 {seen.p99_ms:.1f} ms is above the SLO {slo:g} ms ({predicted:.1f} ms "
                               f"predicted); profile scaled by {factor:.2f}")
        return "; ".join(reasons)
