"""Deployments: from a bundle to replicas in the router, and re-placement while models serve.

Deploy = fetch the bundle -> read and check its config -> profile the version on one worker of
each allowed pool kind (a load with ``profile``, then unloaded) -> re-plan every deployed model
version with the :class:`Replanner` (unchanged ones stay where they are) -> carry out the
capacity-safe moves (load on the new worker, wait until ready, add to the router, only then
unload the old) -> route traffic to the version (all of it, or a canary share). A failure at
any step marks the version FAILED with the reason (the loader's own words for an ONNX file
onnxruntime refuses), emits ``DeployFailed`` and leaves every other model as it was.

While models serve, :meth:`replan_once` (on a periodic tick) feeds the measured rate and p99 of
each version to the Replanner, which re-places those that drifted from the plan. Each replica set
loads with the serving configuration (session options, precision) its performance model predicts
best (:attr:`serving_models`, :mod:`~opml_inference_router.placement.serving`); measuring a
version's configurations re-places it at once when that changes the choice (:meth:`serving_measured`).

Version numbers only grow per model: a number once given (served, retired, rolled back or
undeployed) is never given again, but a deploy that fails before its version serves gives its
number back (:mod:`.versions`).

One deploy, move or re-placement runs at a time (a lock): each starts from the plan the last left.

Router replicas (``following=True``, :mod:`~opml_inference_router.leadership`): a replica that does
not hold the lease **follows** the store: whenever its generation changes it mirrors the stored
versions and traffic onto its own workers (:meth:`follow`: bundles fetched, placed from the stored
profiles, never profiled; retired ones unloaded), writing and announcing nothing, so it serves what
the leader serves. :meth:`take_over` makes it the writer (caught up first, the store's interrupted
deploys marked FAILED, the re-placement tick started); :meth:`step_down` makes it follow again.

The manager coordinates; each step lives in a module of its own: :mod:`.validation` (arguments,
pool kinds), :mod:`.versions` (numbering), :mod:`.profiling`, :mod:`.replan` (the plan and the
moves that carry it out), :mod:`.rollout` (traffic: canary, promote, rollback, retiring),
:mod:`.state` (what Redis keeps), :mod:`.progressive` (a bundle's rollout.yaml: traffic step by step,
decided by analyses). Each change emits one event through the service's
:class:`~opml_common.events.EventEmitter`, built by :mod:`.convert`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path

from google.protobuf.message import Message

from opml_common.errors import FailedPrecondition, InvalidArgument, NotFound, OpmlError
from opml_common.events import EventEmitter
from opml_common.lifecycle import Component, cancel_and_wait
from opml_inference_router.control import convert
from opml_inference_router.control.bundles import BundleFetcher, local_directory
from opml_inference_router.control.observe import Observer
from opml_inference_router.control.pools import PoolManager
from opml_inference_router.control.profiling import profile_version
from opml_inference_router.control.progressive import ProgressiveRollouts, read_rollout_spec
from opml_inference_router.control.replan import ReplicaPlacer
from opml_inference_router.control.rollout import Rollout
from opml_inference_router.control.serving_models import ServingModels
from opml_inference_router.control.state import (
    DEPLOYING,
    FAILED,
    SERVING,
    DeploymentStore,
    ModelRecord,
    Source,
    VersionRecord,
)
from opml_inference_router.control.validation import check_pool_kinds, deploy_arguments
from opml_inference_router.control.versions import VersionNumbers
from opml_inference_router.placement import (
    CostAwareSloPolicy,
    Fleet,
    ModelVersion,
    PlacementPolicy,
    Plan,
    Planner,
    ProfileBook,
    Replan,
    WorkerCheck,
)
from opml_inference_router.placement.fleet_config import LOCAL_SITE
from opml_inference_router.routing import Router
from opml_inference_router.runtime import load_bundle

log = logging.getLogger(__name__)


class DeploymentManager(Component):
    """The deployed models, the current plan and the profiles, and every change to them.

    Side effects: ``start()`` rebuilds what ``store`` remembers and starts the re-placement tick
    (every ``replan_interval_s``; 0: never); ``stop()`` ends the tick. Both idempotent. Workers
    are loaded and unloaded through ``pools``; the router is told of every replica and split; each
    change emits one ``opml.inference.v1.deployment_events`` message through ``events``.
    """

    def __init__(self, *, pools: PoolManager, router: Router, observer: Observer,
                 fetcher: BundleFetcher | None = None, store: DeploymentStore | None = None,
                 events: EventEmitter | None = None, policy: PlacementPolicy | None = None,
                 replan_interval_s: float = 30.0, usable: WorkerCheck | None = None, following: bool = False,
                 follow_interval_s: float = 0.5) -> None:
        if replan_interval_s < 0:
            raise InvalidArgument("replan_interval_s", f"must be >= 0, but got {replan_interval_s}")
        super().__init__()
        self.pools = pools
        self.router = router
        self.models: dict[str, ModelRecord] = {}
        self.serving_models = ServingModels(models=self.models, fleet=pools.fleet, store=store,
                                            unavailable=pools.unavailable_kinds)
        self.serving_models.on_measured = self.serving_measured
        self._placer = ReplicaPlacer(pools=pools, router=router, policy=policy or CostAwareSloPolicy(),
                                     models=self.models, serving=self.serving_models, usable=usable)
        self._rollout = Rollout(router)
        self._versions = VersionNumbers(store)
        self._observer = observer
        self._fetcher = fetcher
        self._store = store
        self._events = events
        self._replan_interval_s = replan_interval_s
        self._lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        self.leading = not following  # writes the store and announces changes; else mirrors the store
        self.waiting: set[ModelVersion] = set()  # restored versions that wait for their hosts (:meth:`place_waiting`)
        self._follow_interval_s = follow_interval_s
        self._followed = -1  # the store generation last mirrored
        self._stop_following = asyncio.Event()
        self.rollouts: ProgressiveRollouts | None = None  # set by ProgressiveRollouts: deploys with rollout.yaml
        pools.on_restart = self.worker_restarted
        pools.on_down = self.worker_down

    # -- lifecycle -------------------------------------------------------------------------------

    async def on_start(self) -> None:
        if self.leading:
            await self._restore()
            self._task = asyncio.create_task(self._tick(), name="replan-tick")
        else:
            await self.follow()
            self._task = asyncio.create_task(self._follow(), name="follow-store")

    async def on_stop(self) -> None:
        if not self.leading:
            await self._end_following()
        task, self._task = self._task, None
        await cancel_and_wait(task)

    # -- replicas: the leader writes, the others follow ------------------------------------------

    async def take_over(self) -> None:
        """This replica now holds the lease: caught up with the store, it writes from now on; a deploy
        the previous leader left DEPLOYING is marked FAILED (as a restart does), the version numbers
        are read again, the re-placement tick starts. Raises: NotLeader, RedisError (the caller retries)."""
        await self._end_following()
        await self.follow()
        async with self._lock:
            await self._versions.load()
            self.leading = True
            for record in self.models.values():  # what waits for the hosts is placed once they register
                interrupted = [e for e in record.versions.values() if e.state == DEPLOYING
                               and ModelVersion(record.name, e.version) not in self.waiting]
                for entry in interrupted:
                    entry.state, entry.reason = FAILED, "the deploy was interrupted: the leading router replica stopped"
                if interrupted:
                    await self._save(record)
        self._task = asyncio.create_task(self._tick(), name="replan-tick")
        log.info("this router replica leads: it deploys, re-places and writes the deployments")

    async def step_down(self) -> None:
        """This replica no longer holds the lease: it stops writing and follows the store again."""
        self.leading = False
        await cancel_and_wait(self._task)
        async with self._lock:  # off the workers it may no longer use (the hosts it let go), writing nothing
            with contextlib.suppress(OpmlError):
                await self._placer.replan({})
        self._task = asyncio.create_task(self._follow(), name="follow-store")
        log.warning("this router replica no longer leads: it follows the deployments the leader writes")

    async def follow(self) -> None:
        """Mirrors the stored deployments onto this replica's workers (see the module): versions served
        here that the store no longer serves are dropped, stored serving versions not served here are
        fetched and placed, each model's split is the stored one; non-serving versions are copied as
        they are. Writes and announces nothing. A version this replica cannot place keeps FAILED here
        with the reason (logged), or waits for hosts where a pool at another site could hold it (the
        leader places on hosts: :meth:`place_waiting`), and is tried again at the next change."""
        if self._store is None:
            return
        generation = await self._store.generation()
        records, profiles = await self._store.load()
        async with self._lock:
            stored = {record.name: record for record in records}
            for name in [name for name in self.models if name not in stored]:
                if name in self.router.models():
                    await self.router.remove_model(name)
                record = self.models.pop(name)
                for number in list(record.versions):
                    self._forget(record, number)
            for record in records:
                mine = self.models.setdefault(record.name, ModelRecord(record.name))
                for number in [n for n, e in mine.versions.items() if n not in record.versions
                               or (e.state == SERVING) != (record.versions[n].state == SERVING)]:
                    self._forget(mine, number)
            self._placer.profiles = ProfileBook.from_dict(profiles)  # after the forgetting, which drops profiles
            for record in records:
                mine = self.models[record.name]
                stable = record.stable
                for entry in sorted(record.versions.values(), key=lambda e: (e.version != stable, -e.version)):
                    if entry.version in mine.versions:
                        continue
                    copy = dataclasses.replace(entry)
                    mine.versions[entry.version] = copy
                    if entry.state != SERVING:
                        continue
                    copy.state = DEPLOYING  # out of the plan's demands until it is placed itself
                    problem = await self._bring_back(mine, copy)
                    if problem is None:
                        copy.state = SERVING
                    elif self._hosts_may_place(copy, problem):  # placed on hosts, which only a leader has
                        copy.reason = f"waiting for its hosts to register: {problem.message}"
                        self.waiting.add(ModelVersion(record.name, copy.version))
                    else:
                        copy.state, copy.reason = FAILED, f"not served by this replica: {problem.message}"
                        log.error("models/%s/versions/%d %s", record.name, copy.version, copy.reason)
                mine.stable, mine.traffic = record.stable, dict(record.traffic)
                self._restore_traffic(mine)
            with contextlib.suppress(OpmlError):  # unloads what was dropped; kept until a later change else
                await self._place()
        self._followed = generation

    async def _end_following(self) -> None:
        """Ends the follower's loop after its round: not cancelled mid-round, where a worker call's
        cancellation comes back as a failed call (UNAVAILABLE) and the loop would go on."""
        task, self._task = self._task, None
        if task is None:
            return
        self._stop_following.set()
        await asyncio.wait({task})
        self._stop_following.clear()

    async def _follow(self) -> None:
        """A follower's loop: mirrors the store each time its generation moves (polled)."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop_following.wait(), self._follow_interval_s)
            if self._stop_following.is_set():
                return
            try:
                if await self._store.generation() != self._followed:  # type: ignore[union-attr]
                    await self.follow()
            except OpmlError as error:
                log.warning("following the deployments failed: %s; trying again", error.message)
            except Exception:  # noqa: BLE001 - Redis away or a bug in one round: the next round tries again
                log.exception("following the deployments failed; trying again")

    # -- queries (a DeploymentView, which convert reads) -----------------------------------------

    @property
    def fleet(self) -> Fleet:
        return self.pools.fleet

    @property
    def plan(self) -> Plan:
        return self._placer.plan

    @property
    def profiles(self) -> ProfileBook:
        return self._placer.profiles

    @property
    def planner(self) -> Planner:
        return self._placer.planner

    def record(self, name: str) -> ModelRecord:
        """Raises: NotFound."""
        record = self.models.get(name)
        if record is None:
            raise NotFound(f"model {name!r} is not deployed (deployed: {', '.join(sorted(self.models)) or 'none'})")
        return record

    def serves_bundle(self, bundle_uuid: str) -> bool:
        """Whether a version deployed from this bundle serves (a redelivered commit is not deployed twice)."""
        return any(entry.bundle_uuid == bundle_uuid and entry.state in (DEPLOYING, SERVING)
                   for record in self.models.values() for entry in record.versions.values())

    def traffic_percent(self, name: str) -> dict[str, float]:
        return self._rollout.percent(name)

    # -- deploy ----------------------------------------------------------------------------------

    async def deploy(self, source: Source, *, version: int = 0, canary_percent: float = 0.0) -> ModelRecord:
        """Deploys the bundle at ``source`` as ``version`` (0: the next number) and returns the model.

        Raises:
            InvalidArgument: a bad argument, a bad config, or an ONNX file the loader refuses
                (the message is the loader's reason).
            NotFound: the bundle or directory does not exist.
            AlreadyExists: that version already serves.
            FailedPrecondition: no allowed pool kind could profile or place the version.
            Unavailable: the bundle-store cannot be reached.
        """
        problem = deploy_arguments(version, canary_percent)
        if problem is not None:
            self.report_failure(source, problem, version=version if problem.field != "version" else 0)
            raise problem
        async with self._lock:
            try:
                directory, bundle_uuid = await self._materialize(source)
                config = (await asyncio.to_thread(load_bundle, directory)).config
                check_pool_kinds(config, self.fleet, self.pools.unavailable_kinds)
                spec = await asyncio.to_thread(read_rollout_spec, directory, config) if self.rollouts else None
                if spec is not None:
                    self.rollouts.check_free(config.name)  # type: ignore[union-attr]
            except OpmlError as error:
                self.report_failure(source, error, version=version)
                raise
            record = self.models.get(config.name) or ModelRecord(config.name)
            try:
                number = self._versions.choose(record, version)
            except (InvalidArgument, FailedPrecondition) as error:
                self.report_failure(source, error, version=version)
                raise
            previous = await self._versions.give(config.name, number)
            entry = VersionRecord(number, source, str(directory), bundle_uuid=bundle_uuid, config=config)
            record.versions[number] = entry
            self.models[config.name] = record
            await self._save(record)
            try:
                await profile_version(self.pools, self.plan, self.profiles, entry, config, self.router)
                await self._save_profiles()
                await self._place(must_place=ModelVersion(config.name, number))
            except OpmlError as error:
                entry.state, entry.reason = FAILED, error.message
                await self._save(record)
                await self._versions.release(config.name, number, previous)
                self._failed(config.name, number, source, error)
                raise
            entry.state = SERVING
            stable = record.stable if spec is not None and record.stable not in (None, number) else None
            if stable is not None:  # the rollout gives it traffic, step by step
                self._rollout.set(record, {str(stable): 100.0})
                cause = "rollout"
            else:
                cause = self._rollout.route_new(record, number, canary_percent)
            if cause == "deploy":
                await self._retire(record)
            self._retire_failed(record)
            await self._traffic_changed(record, cause)
            self._emit(convert.deployed_event(self, record, number), config.name)
            if stable is not None:
                await self.rollouts.begin(config.name, number, stable, spec)  # type: ignore[union-attr,arg-type]
            log.info("deployed models/%s/versions/%d (%s)", config.name, number, cause)
            return record

    async def undeploy(self, name: str) -> None:
        """Stops serving every version of ``name`` and unloads its replicas. Raises: NotFound."""
        async with self._lock:
            record = self.record(name)
            if name in self.router.models():
                await self.router.remove_model(name)
            del self.models[name]
            await self._place()
            for number in list(record.versions):
                self._forget(record, number)
            if self._store is not None:
                await self._store.delete_model(name)
            await self._save_profiles()
            self._emit(convert.undeployed_event(name), name)

    # -- traffic ---------------------------------------------------------------------------------

    async def set_traffic(self, name: str, weights: Mapping[str, float], *, cause: str = "set_traffic") -> ModelRecord:
        """Raises: NotFound (model or a weighted version that does not serve), InvalidArgument."""
        async with self._lock:
            record = self.record(name)
            self._rollout.set(record, weights)
            await self._traffic_changed(record, cause)
            return record

    async def promote(self, name: str, version: int = 0) -> ModelRecord:
        """Gives ``version`` (0: the canary) all traffic, then retires what the version policy no
        longer serves. Raises: NotFound, FailedPrecondition (no single canary)."""
        async with self._lock:
            record = self.record(name)
            self._rollout.promote(record, version)
            await self._retire(record)
            await self._traffic_changed(record, "promote")
            return record

    async def rollback(self, name: str) -> ModelRecord:
        """All traffic back to the stable version; the other versions are retired.
        Raises: NotFound, FailedPrecondition (no stable version)."""
        async with self._lock:
            record = self.record(name)
            stable = self._rollout.rollback(record)
            for entry in record.serving():
                if entry.version != stable:
                    self._forget(record, entry.version)
            await self._retire(record)
            await self._traffic_changed(record, "rollback")
            return record

    # -- re-placement ----------------------------------------------------------------------------

    async def replan_once(self, *, regrow: bool = False, measured: bool = True) -> Replan:
        """Re-places the versions whose measured rate or p99 left the plan (the Replan says why and
        what moved; its profiles, calibrated by what serving measured, are kept and stored), those on
        workers placement may no longer use, and (``regrow``: a worker came back) those short of replicas.
        ``measured`` False: no measurement is read (a host change's window holds its failover's waits,
        which are no measure of a replica's speed)."""
        async with self._lock:
            observations = self._observer.observe(list(self.plan.placements)) if measured else {}
            replan = await self._placer.replan(observations, regrow=regrow)
            if replan.moves:
                self._placement_changed(replan)
            if replan.reasons:
                await self._save_profiles()
            return replan

    async def serving_measured(self, model: str, version: int) -> None:
        """New serving-configuration measurements of a version: re-places what they change the
        configuration of (reloaded in place, announced with PlacementChanged). A re-placement that
        fails leaves the placement as it was (logged): the measurements are kept either way."""
        async with self._lock:
            try:
                replan = await self._placer.replan({})
            except OpmlError as error:
                log.warning("re-placement after measuring models/%s/versions/%d failed: %s", model, version,
                            error.message)
                return
            if replan.moves:
                self._placement_changed(replan)

    async def move_replica(self, model: ModelVersion, old: str, new: str, reason: str) -> Replan | None:
        """Moves one replica of a version between workers (:meth:`ReplicaPlacer.move`), announced with
        PlacementChanged; None when there is nothing to move. Raises: what the move raises."""
        async with self._lock:
            replan = await self._placer.move(model, old, new, reason)
            if replan is not None:
                self._placement_changed(replan)
            return replan

    async def reconcile_worker(self, worker_id: str) -> list[ModelVersion]:
        """Unloads from a worker what the plan does not place there (:meth:`ReplicaPlacer.reconcile`)."""
        async with self._lock:
            return await self._placer.reconcile(worker_id)

    def worker_down(self, worker_id: str, address: str, reason: str, back_in_s: float) -> None:
        """Marks the replicas on a dead worker down in the router at once (no lock: a deploy in progress
        must not delay it), so no request is sent there and those that find no other replica wait for
        its restart, within their deadlines, or fail saying when it is expected back."""
        marked = self.router.replica_down(address, reason, back_in_s)
        log.warning("%s: %d replicas marked down, expected back in ~%.1f s", reason, marked, back_in_s)

    async def worker_restarted(self, worker_id: str, old: str, new: str) -> None:
        """Loads the replicas the plan has on a restarted worker and moves the router to its address."""
        async with self._lock:
            await self._placer.worker_restarted(worker_id, old, new)
            self._emit(convert.placement_event(self, [f"worker {worker_id} restarted at {new}"]), "placement")

    # -- steps -----------------------------------------------------------------------------------

    async def _materialize(self, source: Source, bundle_uuid: str = "") -> tuple[Path, str]:
        if self._fetcher is None:
            if not source.model_dir:
                raise FailedPrecondition("this router has no bundle-store client; deploy from a model_dir")
            return local_directory(source), ""
        return await self._fetcher.fetch(source, bundle_uuid=bundle_uuid)

    async def _place(self, *, must_place: ModelVersion | None = None) -> None:
        """Re-plans and applies the moves (:meth:`ReplicaPlacer.place`), announcing a changed placement."""
        replan = await self._placer.place(must_place=must_place)
        if replan.moves:
            self._placement_changed(replan)

    async def _retire(self, record: ModelRecord) -> None:
        """Drops the serving versions that neither the stable one's version policy keeps nor take traffic."""
        retiring = self._rollout.retiring(record)
        if record.stable is None or not record.serving():
            return
        for number in retiring:
            self._forget(record, number)
        try:
            await self._place()
        except OpmlError as error:  # the retired versions keep their replicas until a later re-plan
            log.warning("unloading retired versions of %s failed: %s", record.name, error.message)
        await self._save_profiles()

    def _forget(self, record: ModelRecord, number: int) -> None:
        """Drops a retired version: its record, profiles and measurements (the next re-plan unloads it)."""
        del record.versions[number]
        model = ModelVersion(record.name, number)
        self._placer.forget(model)
        self._observer.forget(model)

    async def _restore(self) -> None:
        """Rebuilds the stored deployments on fresh workers: bundles fetched again where missing,
        placement from the stored profiles, traffic as it was.

        Each version comes back on its own (the stable one first, then the newest first): fetched,
        read, then placed with a plan that holds the versions restored so far, so one version that
        cannot come back (its bundle gone, a file the loader refuses, no room) fails alone, with that
        reason, and the others serve. What cannot come back is announced (DeployFailed) and then
        retired if a newer version of its model serves (:meth:`_retire_failed`), else it stays FAILED
        with its reason, so ``get`` says why nothing serves, until a newer version serves.

        A version that finds no room while the fleet has pools on host agents' machines (they register
        again only after this restart) is not failed: it waits, DEPLOYING with that reason and still
        SERVING in the store, and is placed once hosts join (:meth:`place_waiting`)."""
        if self._store is None:
            return
        records, profiles = await self._store.load()
        await self._versions.load()
        if not records:
            return
        async with self._lock:
            self._placer.profiles = ProfileBook.from_dict(profiles)
            for record in records:
                self.models[record.name] = record
                for entry in record.versions.values():
                    if entry.state == DEPLOYING:
                        entry.state, entry.reason = FAILED, "the deploy was interrupted by a restart of the router"
                stable = record.stable
                order = sorted(record.serving(), key=lambda e: (e.version != stable, -e.version))
                for entry in order:
                    entry.state = DEPLOYING  # out of the plan's demands until it is placed itself
                for entry in order:
                    problem = await self._bring_back(record, entry)
                    if problem is None:
                        entry.state = SERVING
                    elif self._hosts_may_place(entry, problem):
                        entry.reason = f"waiting for its hosts to register after a restart: {problem.message}"
                        self.waiting.add(ModelVersion(record.name, entry.version))
                        log.warning("models/%s/versions/%d is %s", record.name, entry.version, entry.reason)
                    else:
                        entry.state, entry.reason = FAILED, f"not restored after a restart: {problem.message}"
                        log.error("models/%s/versions/%d %s", record.name, entry.version, entry.reason)
                        self._failed(record.name, entry.version, entry.source, problem)
                if not any(model.name == record.name for model in self.waiting):  # else once they are placed
                    await self._restored(record)
            await self._save_profiles()
            log.info("restored deployments: %s", {name: [f"{e.version} {e.state}" for e in r.versions.values()]
                                                  for name, r in sorted(self.models.items())})

    async def _restored(self, record: ModelRecord) -> None:
        """A restored model's traffic as it was, its failed versions retired, its record saved."""
        self._restore_traffic(record)
        self._retire_failed(record)
        await self._save(record)

    def _hosts_may_place(self, entry: VersionRecord, problem: OpmlError) -> bool:
        """Whether a version that found no room may find it once host agents register (its config allows
        a pool kind that a pool at another site than the router's runs)."""
        kinds = set(entry.config.pool_kinds) if entry.config is not None else set()
        return isinstance(problem, FailedPrecondition) and any(
            worker.site != LOCAL_SITE and worker.kind.name in kinds for worker in self.fleet.workers)

    async def place_waiting(self) -> list[ModelVersion]:
        """Places the restored versions that wait for their hosts (:meth:`_restore`), now that hosts
        changed; a model whose versions all came back gets its traffic as it was. Returns those placed."""
        placed = []
        async with self._lock:
            for model in sorted(self.waiting):
                record = self.models.get(model.name)
                entry = record.versions.get(model.version) if record is not None else None
                if entry is None or entry.state != DEPLOYING:
                    self.waiting.discard(model)
                    continue
                problem = await self._bring_back(record, entry)  # type: ignore[arg-type]
                if problem is not None:
                    entry.reason = f"waiting for its hosts to register after a restart: {problem.message}"
                    continue
                entry.state, entry.reason = SERVING, ""
                self.waiting.discard(model)
                placed.append(model)
                log.info("%s placed now that its hosts registered", model)
                if not any(other.name == model.name for other in self.waiting):
                    await self._restored(record)  # type: ignore[arg-type]
        return placed

    async def _bring_back(self, record: ModelRecord, entry: VersionRecord) -> OpmlError | None:
        """Fetches (where the work directory lost it), reads and places one stored version; the error
        that stopped it, else None. A failed placement is undone (:meth:`ReplicaPlacer.apply`)."""
        try:
            directory, _ = await self._materialize(entry.source, entry.bundle_uuid)
            entry.directory = str(directory)
            entry.config = (await asyncio.to_thread(load_bundle, directory)).config
            await self._place(must_place=ModelVersion(record.name, entry.version))
        except OpmlError as error:
            return error
        return None

    def _restore_traffic(self, record: ModelRecord) -> None:
        """The stored split over the versions that came back; when the stable one did not, the newest
        that did takes all traffic (logged)."""
        serving = {str(entry.version) for entry in record.serving()}
        if not serving or record.name not in self.router.models():
            record.stable = None
            return
        record.traffic = {v: w for v, w in record.traffic.items() if v in serving}
        if record.stable is None or str(record.stable) not in serving:
            newest = max(record.serving(), key=lambda e: e.version).version
            log.warning("models/%s: stable version %s did not come back after the restart; version %d takes "
                        "all traffic", record.name, record.stable, newest)
            record.stable, record.traffic = newest, {str(newest): 1.0}
        with contextlib.suppress(OpmlError):
            self._rollout.restore(record)

    def _retire_failed(self, record: ModelRecord) -> None:
        """Drops the FAILED versions older than the newest serving one: a newer version serves in their
        place, so nothing is left to explain (each failure was announced, with its reason, when it
        happened). A FAILED version newer than every serving one stays, with its reason."""
        serving = [entry.version for entry in record.serving()]
        if not serving:
            return
        for entry in list(record.versions.values()):
            if entry.state == FAILED and entry.version < max(serving):
                log.warning("models/%s/versions/%d retired (version %d serves): it was FAILED: %s",
                            record.name, entry.version, max(serving), entry.reason)
                self._forget(record, entry.version)

    async def _tick(self) -> None:
        if not self._replan_interval_s:
            return
        while True:
            await asyncio.sleep(self._replan_interval_s)
            try:
                await self.replan_once()
            except OpmlError as error:
                log.warning("re-placement skipped: %s", error.message)
            except Exception:  # noqa: BLE001 - a bug in one round must not end re-placement for good
                log.exception("re-placement failed")

    # -- records and events ----------------------------------------------------------------------

    async def _save(self, record: ModelRecord) -> None:
        self._rollout.record_split(record)
        if self._store is not None:
            await self._store.save_model(record)

    async def _save_profiles(self) -> None:
        if self._store is not None:
            await self._store.save_profiles(self.profiles.to_dict())

    async def _traffic_changed(self, record: ModelRecord, cause: str) -> None:
        await self._save(record)
        self._emit(convert.traffic_event(self, record, cause), record.name)

    def _placement_changed(self, replan: Replan) -> None:
        reasons = [f"{model}: {reason}" for model, reason in sorted(replan.reasons.items())]
        log.info("placement changed (%d moves): %s", len(replan.moves), "; ".join(reasons))
        self._emit(convert.placement_event(self, reasons, replan), "placement")

    def report_failure(self, source: Source, error: OpmlError, *, version: int = 0) -> None:
        """Emits DeployFailed for a deploy that failed before its bundle named the model."""
        self._failed(None, version, source, error)

    def _failed(self, name: str | None, version: int, source: Source, error: OpmlError) -> None:
        log.warning("deploy of %s failed: %s", source, error.message)
        self._emit(convert.failed_event(name, version, source, error), name or str(source))

    def _emit(self, message: Message, subject: str) -> None:
        if self._events is not None and self.leading:  # a follower's mirroring is no change to announce
            self._events.emit(message, subject=subject)
