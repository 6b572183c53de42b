"""Placement carried out: the plan, the replicas each worker hosts, and the capacity-safe moves
between plans (load on the new worker, wait until ready, add to the router, only then unload the
old; on a failure the moves done are undone).

The ``k`` replicas a plan puts on one worker are one loaded version with ``k`` instances (sessions,
one slot each). A replica whose batch cap alone changes is re-sized in place (the worker re-caps
its batcher, the router gets the new concurrency limit); one whose session options change is
re-loaded in place (the worker builds the new sessions beside the serving ones). A worker that
restarts gets its replicas loaded again and the router its new address.

Each replica set loads with the serving configuration the planner's chooser picks
(:mod:`~opml_inference_router.placement.serving`): before each plan, the performance models of
:class:`~.serving_models.ServingModels` predict every candidate configuration of each demanded
version on each kind it may run on (none where nothing is measured: the defaults stay).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

from opml_common.errors import DeadlineExceeded, FailedPrecondition, NotFound, OpmlError, Unavailable
from opml_inference_router.control.pools import PoolManager
from opml_inference_router.control.serving_models import ServingModels
from opml_inference_router.control.state import SERVING, ModelRecord
from opml_inference_router.placement import (
    AddReplica,
    ModelDemand,
    ModelVersion,
    Observation,
    PlacementPolicy,
    Plan,
    Planner,
    ProfileBook,
    ProfilePredictor,
    RemoveReplica,
    Replan,
    Replanner,
    Replica,
    ResizeReplica,
    ServingConfigChooser,
    ServingTable,
    WorkerCheck,
    check_moves,
    plan_moves,
)
from opml_inference_router.routing import ModelPolicy, Router
from opml_inference_router.routing.limits import largest, request_limit
from opml_inference_router.routing.policy import in_flight_limit, queue_limit

log = logging.getLogger(__name__)


class ReplicaPlacer:
    """The plan and profiles of the deployed versions (``models``, shared with the manager), and the
    loads, unloads and router changes that take the workers from one plan to the next. Not locked:
    the manager runs one change at a time."""

    def __init__(self, *, pools: PoolManager, router: Router, policy: PlacementPolicy,
                 models: Mapping[str, ModelRecord], serving: ServingModels | None = None,
                 usable: WorkerCheck | None = None) -> None:
        self.pools = pools
        self.router = router
        # a kind a version could not be profiled on (no room, or its workers down then) is planned by
        # prediction, once a worker of it is live
        predictor = ProfilePredictor(fleet=pools.fleet, serving=lambda kind: any(
            pools.get(worker.id).alive for worker in pools.fleet.workers_of(kind)))
        self._serving = serving
        self._tables: dict[tuple[ModelVersion, str], ServingTable] = {}
        self.chooser = ServingConfigChooser(fleet=pools.fleet, policy=policy, slot_threads=pools.slot_threads,
                                            tables=lambda model, kind: self._tables.get((model, kind)))
        self.planner = Planner(fleet=pools.fleet, policy=policy, predictor=predictor, chooser=self.chooser,
                               usable=usable)
        self.replanner = Replanner(planner=self.planner)
        self.plan = Plan({})
        self.profiles = ProfileBook()
        self._models = models
        # the planned replicas each worker hosts per version: one loaded version, one instance each
        self._hosted: defaultdict[tuple[str, ModelVersion], list[Replica]] = defaultdict(list)

    def demands(self, extra: ModelVersion | None = None) -> list[ModelDemand]:
        """The serving versions' demands (and ``extra``'s, a version being deployed)."""
        demands = []
        for record in self._models.values():
            for entry in record.versions.values():
                model = ModelVersion(record.name, entry.version)
                if entry.config is not None and (entry.state == SERVING or model == extra):
                    demands.append(ModelDemand(entry.config, entry.version, entry.config.expected_rate_rps))
        return demands

    async def place(self, *, must_place: ModelVersion | None = None) -> Replan:
        """Re-plans with the current demands (no measurements: only new and dropped versions move)
        and applies the moves. Raises: FailedPrecondition when ``must_place`` finds no room."""
        demands = self.demands(extra=must_place)
        await self._predict(demands)
        replan = self.replanner.replan(self.plan, demands, self.profiles, {})
        if must_place is not None and must_place in replan.plan.unplaced:
            raise FailedPrecondition(f"{must_place} cannot be placed: {replan.plan.unplaced[must_place]}")
        await self._adopt(replan)
        return replan

    async def replan(self, observations: Mapping[ModelVersion, Observation], *, regrow: bool = False) -> Replan:
        """Re-places the versions whose measured rate or p99 left the plan, whose serving configuration
        the latest measurements change, or (``regrow``) that run short of their replicas; keeps the
        calibrated profiles."""
        demands = self.demands()
        await self._predict(demands)
        replan = self.replanner.replan(self.plan, demands, self.profiles, observations, regrow=regrow)
        await self._adopt(replan)
        self.profiles = replan.profiles
        return replan

    async def _adopt(self, replan: Replan) -> None:
        """Carries out the replan's moves; without any, takes its plan as it is (the same replicas,
        a serving configuration's reason maybe renewed)."""
        if replan.moves:
            await self.apply(replan)
        else:
            self.plan = replan.plan

    async def _predict(self, demands: list[ModelDemand]) -> None:
        """The serving-configuration predictions the chooser plans with, for each demand on each kind
        it may run on (kept only where a performance model answers)."""
        self._tables = {}
        if self._serving is None:
            return
        for demand in demands:
            for name in demand.config.pool_kinds:
                kind = self.pools.fleet.kinds.get(name)
                if kind is None or not self.pools.fleet.workers_of(name):
                    continue
                table = await self._serving.table(demand.config.name, demand.version, name,
                                                  self.chooser.candidates(demand, kind))
                if table is not None:
                    self._tables[demand.model, name] = table

    async def move(self, model: ModelVersion, old: str, new: str, reason: str) -> Replan | None:
        """Moves one replica of ``model`` from worker ``old`` to ``new`` (same option), capacity-safe: loaded
        and ready on ``new`` before ``old`` unloads. None when the plan no longer has it on ``old``, already
        has it on ``new``, or ``new`` may not host it (:attr:`Planner.usable`).
        Raises: FailedPrecondition (``new`` lacks the room), what loading raises (the moves undone)."""
        placed = self.plan.placements.get(model)
        if placed is None or old not in placed.workers or new in placed.workers:
            return None
        demand = next((d for d in self.demands() if d.model == model), None)
        if demand is None or new in self.planner.refusals(demand):
            return None
        workers = tuple(new if worker == old else worker for worker in placed.workers)
        target = Plan({**self.plan.placements, model: dataclasses.replace(placed, workers=workers)}, self.plan.unplaced)
        replan = Replan(target, plan_moves(self.plan, target, self.pools.fleet), {model: reason}, self.profiles)
        await self.apply(replan)
        return replan

    async def reconcile(self, worker: str) -> list[ModelVersion]:
        """Unloads what the worker serves that the plan does not put there (a host back from a cut still
        holds what was re-placed off it while it was away), so its slots hold what the plan counts;
        returns what was unloaded. Raises: Unavailable."""
        client = self.pools.client(worker)
        stale = [ModelVersion(name, version) for name, version in sorted(await client.loaded())
                 if not self._hosted.get((worker, ModelVersion(name, version)))]
        for model in stale:
            with contextlib.suppress(NotFound):
                await client.unload(model.name, model.version)
        return stale

    def forget(self, model: ModelVersion) -> None:
        """Drops a retired version's profiles (the next re-plan unloads it)."""
        self.profiles = ProfileBook(profile for profile in self.profiles if profile.model != model)

    async def apply(self, replan: Replan) -> None:
        """Carries out the moves in order; on a failure, undoes the ones done and re-raises."""
        check_moves(self.plan, replan.plan, replan.moves, self.pools.fleet)
        done: list[AddReplica | ResizeReplica | RemoveReplica] = []
        try:
            for action in replan.moves:
                if isinstance(action, AddReplica):
                    await self._add(action.replica)
                    done.append(action)
                elif isinstance(action, ResizeReplica):
                    await self._resize(action.old, action.new)
                    done.append(action)
                elif isinstance(action, RemoveReplica):
                    await self._remove(action.replica)
                    done.append(action)
                else:  # WaitReady: loads return once the replica serves; now it takes traffic
                    for replica in action.replicas:
                        self._route(replica)
        except OpmlError:
            for action in reversed(done):  # best effort: a retired version's record is gone (KeyError)
                with contextlib.suppress(OpmlError, KeyError):
                    if isinstance(action, AddReplica):
                        await self._remove(action.replica)
                    elif isinstance(action, ResizeReplica):
                        await self._resize(action.new, action.old)
                    else:
                        await self._add(action.replica)
                        self._route(action.replica)
            raise
        self.plan = replan.plan
        for name in {model.name for model in self.plan.placements}:
            if name in self.router.models():
                self.router.set_model(name, self.policy(name))

    async def worker_restarted(self, worker_id: str, old: str, new: str) -> None:
        """Loads the replicas the plan has on a restarted worker and moves the router to its address."""
        for (worker, model), hosted in list(self._hosted.items()):
            if worker != worker_id or not hosted:
                continue
            name, number = model.name, model.version
            record = self._models.get(name)
            if record is None or number not in record.versions:  # retired, its moves not done (a failed
                # re-plan): nothing to load it from; the router forgets the dead address, the next plan the rest
                with contextlib.suppress(NotFound):
                    await self.router.remove_replica(name, str(number), old)
                continue
            try:
                await self._load(worker, model)
            except OpmlError as error:
                log.error("re-loading %s on restarted worker %s failed: %s", model, worker_id, error.message)
                continue
            self.router.add_replica(name, str(number), new)  # first: the version never goes without a replica
            with contextlib.suppress(NotFound):
                await self.router.remove_replica(name, str(number), old)

    def policy(self, name: str) -> ModelPolicy:
        """The router's policy for ``name``: its newest config's SLO, limits sized to the planned replicas,
        and the largest request size any of its versions' configs allows (a request may name a version)."""
        record = self._models[name]
        configured = [e for e in record.versions.values() if e.config is not None]
        newest = max(configured, key=lambda e: e.version)
        placed = [part for m, s in self.plan.placements.items() if m.name == name for part in s.parts()]
        replicas = sum(len(s.workers) for s in placed)
        rows = sum(len(s.workers) * s.option.max_batch for s in placed)  # what the planned batch caps take
        limits: dict[str, object] = (
            {"max_concurrency": in_flight_limit(rows), "max_queue": queue_limit(in_flight_limit(rows))} if rows else {})
        default = self.router.max_request_bytes
        limits["max_request"] = largest([request_limit(e.config, default=default)  # type: ignore[arg-type]
                                         for e in configured])
        return ModelPolicy.for_model(newest.config, replicas=max(1, replicas), **limits)  # type: ignore[arg-type]

    async def _add(self, replica: Replica) -> None:
        """Loads the version on the worker, or gives the loaded one another instance (in place)."""
        hosted = self._hosted[replica.worker, replica.model]
        hosted.append(replica)
        try:
            await self._load(replica.worker, replica.model)
        except OpmlError:
            hosted.remove(replica)
            if not hosted:
                del self._hosted[replica.worker, replica.model]
            raise

    async def _resize(self, old: Replica, new: Replica) -> None:
        """Re-caps the loaded version's batcher in place (the router's limit follows with the plan)."""
        hosted = self._hosted[old.worker, old.model]
        hosted[hosted.index(old)] = new
        try:
            await self._load(new.worker, new.model)
        except OpmlError:
            hosted[hosted.index(new)] = old
            raise

    async def _load(self, worker: str, model: ModelVersion) -> None:
        """Makes the worker serve ``model`` as its hosted replicas say: one instance per replica, the
        newest one's precision, batch cap and session options (a worker changes a loaded version in
        place, or reloads it beside the serving sessions for other options)."""
        hosted = self._hosted[worker, model]
        entry = self._models[model.name].versions[model.version]
        await self.pools.client(worker).load(model.name, path=Path(entry.directory), version=model.version,
                                             precision=hosted[-1].precision, instances=len(hosted),
                                             max_batch=hosted[-1].max_batch, session=hosted[-1].session)

    def _route(self, replica: Replica) -> None:
        name = replica.model.name
        if name not in self.router.models():
            self.router.set_model(name, self.policy(name))
        self.router.add_replica(name, str(replica.model.version), self.pools.get(replica.worker).address)

    async def _remove(self, replica: Replica) -> None:
        """Retires one instance of the version, or unloads it with its last one. A retired version (its
        record gone: undeployed, or no longer served) keeps its other instances on the worker until the
        same moves remove them: there is no bundle left to re-load it from, and no need."""
        key = (replica.worker, replica.model)
        hosted = self._hosted[key]
        hosted.remove(replica)
        if hosted:
            record = self._models.get(replica.model.name)
            if record is None or replica.model.version not in record.versions:
                return
            try:
                await self._load(*key)
            except (Unavailable, DeadlineExceeded):  # a worker down or cut off comes back with what _hosted says
                pass
            except OpmlError:
                hosted.append(replica)
                raise
            return
        del self._hosted[key]
        name, number = replica.model.name, str(replica.model.version)
        with contextlib.suppress(NotFound):
            await self.router.remove_replica(name, number, self.pools.get(replica.worker).address)
        with contextlib.suppress(NotFound, Unavailable, DeadlineExceeded):
            await self.pools.client(replica.worker).unload(name, replica.model.version)
