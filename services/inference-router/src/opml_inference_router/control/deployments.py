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
                 replan_interval_s: float = 30.0, usable: WorkerCheck | None = None) -> None:
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
        self.rollouts: ProgressiveRollouts | None = None  # set by ProgressiveRollouts: deploys with rollout.yaml
        pools.on_restart = self.worker_restarted
        pools.on_down = self.worker_down

    # -- lifecycle -------------------------------------------------------------------------------

    async def on_start(self) -> None:
        await self._restore()
        self._task = asyncio.create_task(self._tick(), name="replan-tick")

    async def on_stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

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

    async def replan_once(self) -> Replan:
        """Re-places the versions whose measured rate or p99 left the plan (the Replan says why and
        what moved; its profiles, calibrated by what serving measured, are kept and stored)."""
        async with self._lock:
            replan = await self._placer.replan(self._observer.observe(list(self.plan.placements)))
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
        with its reason, so ``get`` says why nothing serves, until a newer version serves."""
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
                        continue
                    entry.state, entry.reason = FAILED, f"not restored after a restart: {problem.message}"
                    log.error("models/%s/versions/%d %s", record.name, entry.version, entry.reason)
                    self._failed(record.name, entry.version, entry.source, problem)
                self._restore_traffic(record)
                self._retire_failed(record)
                await self._save(record)
            await self._save_profiles()
            log.info("restored deployments: %s", {name: [f"{e.version} {e.state}" for e in r.versions.values()]
                                                  for name, r in sorted(self.models.items())})

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
        self._emit(convert.placement_event(self, reasons, replan), "placement")

    def report_failure(self, source: Source, error: OpmlError, *, version: int = 0) -> None:
        """Emits DeployFailed for a deploy that failed before its bundle named the model."""
        self._failed(None, version, source, error)

    def _failed(self, name: str | None, version: int, source: Source, error: OpmlError) -> None:
        log.warning("deploy of %s failed: %s", source, error.message)
        self._emit(convert.failed_event(name, version, source, error), name or str(source))

    def _emit(self, message: Message, subject: str) -> None:
        if self._events is not None:
            self._events.emit(message, subject=subject)
