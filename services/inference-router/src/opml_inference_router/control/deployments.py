"""Deployments: from a bundle to replicas in the router, and re-placement while models serve.

Deploy = fetch the bundle -> read and check its config -> profile the version on one worker of
each allowed pool kind (a load with ``profile``, then unloaded) -> re-plan every deployed model
version with the :class:`Replanner` (unchanged ones stay where they are) -> carry out the
capacity-safe moves (load on the new worker, wait until ready, add to the router, only then
unload the old) -> route traffic to the version (all of it, or a canary share). A failure at
any step marks the version FAILED with the reason (the loader's own words for an ONNX file
onnxruntime refuses), emits ``DeployFailed`` and leaves every other model as it was.

While models serve, :meth:`replan_once` (on a periodic tick) feeds the measured rate and p99 of
each version to the Replanner, which re-places those that drifted from the plan. A replica whose
batch cap alone changes is re-sized in place (the worker re-caps its batcher, the router gets the
new concurrency limit). The ``k`` replicas a plan puts on one worker are one loaded version with
``k`` instances (sessions, one slot each). A worker that restarts gets its replicas loaded again
and the router its new address.

Version numbers only grow per model: a number once given (served, retired, rolled back or
undeployed) is never given again, and the highest is kept in Redis across restarts.

One deploy, move or re-placement runs at a time (a lock): each starts from the plan the last left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

from google.protobuf.message import Message
from opml_common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OpmlError,
    ResourceExhausted,
    Unavailable,
)
from opml.inference.v1 import deployment_events_pb2 as events

from opml_inference_router.control import convert
from opml_inference_router.control.bundles import BundleFetcher, local_directory
from opml_inference_router.control.observe import Observer
from opml_inference_router.control.pools import PoolManager
from opml_inference_router.control.state import (
    DEPLOYING,
    FAILED,
    SERVING,
    DeploymentStore,
    ModelRecord,
    Source,
    VersionRecord,
)
from opml_inference_router.placement import (
    AddReplica,
    CostAwareSloPolicy,
    ModelConfig,
    ModelDemand,
    ModelVersion,
    Plan,
    PlacementPolicy,
    Planner,
    ProfileBook,
    RemoveReplica,
    Replan,
    Replanner,
    Replica,
    ResizeReplica,
    check_moves,
)
from opml_inference_router.routing import ModelPolicy, Router
from opml_inference_router.runtime import load_bundle

log = logging.getLogger(__name__)

EventSink = Callable[[Message, str], Awaitable[None]]
"""``emit(message, subject)``: publishes one DEPLOYMENTS event (the service's outbox)."""

# Load errors that say the bundle itself is bad: the deploy fails at once with the loader's reason.
_BUNDLE_FAULTS = (InvalidArgument, NotFound)


class DeploymentManager:
    """The deployed models, the current plan and the profiles, and every change to them.

    Side effects: ``start()`` rebuilds what ``store`` remembers and starts the re-placement tick
    (every ``replan_interval_s``; 0: never); ``stop()`` ends the tick. Both idempotent. Workers
    are loaded and unloaded through ``pools``; the router is told of every replica and split.
    """

    def __init__(self, *, pools: PoolManager, router: Router, observer: Observer,
                 fetcher: BundleFetcher | None = None, store: DeploymentStore | None = None,
                 emit: EventSink | None = None, policy: PlacementPolicy | None = None,
                 replan_interval_s: float = 30.0) -> None:
        if replan_interval_s < 0:
            raise InvalidArgument("replan_interval_s", f"must be >= 0, but got {replan_interval_s}")
        self.pools = pools
        self.fleet = pools.fleet
        self.router = router
        self.planner = Planner(fleet=self.fleet, policy=policy or CostAwareSloPolicy())
        self.replanner = Replanner(planner=self.planner)
        self.plan = Plan({})
        self.profiles = ProfileBook()
        self.models: dict[str, ModelRecord] = {}
        self._observer = observer
        self._fetcher = fetcher
        self._store = store
        self._emit = emit
        self._replan_interval_s = replan_interval_s
        # the planned replicas each worker hosts per version: one loaded version, one instance each
        self._hosted: defaultdict[tuple[str, ModelVersion], list[Replica]] = defaultdict(list)
        self._last_version: dict[str, int] = {}  # the highest version number ever given, per model
        self._lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        pools.on_restart = self.worker_restarted

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is not None:
            return
        await self._restore()
        self._task = asyncio.create_task(self._tick(), name="replan-tick")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # -- queries ---------------------------------------------------------------------------------

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
        if name not in self.router.models():
            return {}
        weights = self.router.describe(name)["traffic"]
        total = sum(weights.values())
        return {version: 100.0 * weight / total for version, weight in weights.items() if weight > 0} if total else {}

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
        problem = None
        if version < 0:
            problem = InvalidArgument("version", f"must be >= 1, or 0 for the next version, but got {version}")
        elif not 0 <= canary_percent < 100:
            problem = InvalidArgument("canary_percent", f"must be in [0, 100) (0: all traffic), but got "
                                                        f"{canary_percent}")
        if problem is not None:
            await self.report_failure(source, problem, version=version)
            raise problem
        async with self._lock:
            try:
                directory, bundle_uuid = await self._materialize(source)
                config = (await asyncio.to_thread(load_bundle, directory)).config
                self._check_kinds(config)
            except OpmlError as error:
                await self.report_failure(source, error, version=version)
                raise
            record = self.models.get(config.name) or ModelRecord(config.name)
            last = max(self._last_version.get(config.name, 0), max(record.versions, default=0))
            number = version or last + 1
            existing = record.versions.get(number)
            if existing is not None and existing.state == SERVING:
                raise AlreadyExists(f"models/{config.name}/versions/{number} already serves; deploy another "
                                    f"version or undeploy the model first")
            if number <= last and existing is None:  # a failed version may be deployed again, nothing else
                error = InvalidArgument("version", f"must be > {last} (0: the next): models/{config.name} has "
                                                   f"given versions up to {last}, and a number is never reused")
                await self.report_failure(source, error, version=version)
                raise error
            await self._give_version(config.name, number)
            entry = VersionRecord(number, source, str(directory), bundle_uuid=bundle_uuid, config=config)
            record.versions[number] = entry
            self.models[config.name] = record
            await self._save(record)
            try:
                await self._profile(entry, config)
                await self._place(must_place=ModelVersion(config.name, number))
            except OpmlError as error:
                entry.state, entry.reason = FAILED, error.message
                await self._save(record)
                await self._failed(config.name, number, source, error)
                raise
            entry.state = SERVING
            if canary_percent and record.stable is not None and record.stable != number:
                self.router.start_canary(config.name, str(number), canary_percent)
                cause = "canary"
            else:
                self.router.promote(config.name, str(number))
                cause = "deploy"
                await self._retire(record)
            await self._traffic_changed(record, cause)
            await self._notify(events.ModelDeployed(deployment=convert.deployment(self, record), version=number),
                               config.name)
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
                await self._store.save_profiles(self.profiles.to_dict())
            await self._notify(events.ModelUndeployed(model=name), name)

    # -- traffic ---------------------------------------------------------------------------------

    async def set_traffic(self, name: str, weights: Mapping[str, float]) -> ModelRecord:
        """Raises: NotFound (model or a weighted version that does not serve), InvalidArgument."""
        async with self._lock:
            record = self.record(name)
            serving = {str(entry.version) for entry in record.serving()}
            for version, weight in weights.items():
                if weight > 0 and version not in serving:
                    raise NotFound(f"models/{name}/versions/{version} does not serve (serving: {sorted(serving)})")
            self.router.set_traffic(name, dict(weights))
            stable = self.router.describe(name)["stable"]
            record.stable = int(stable) if stable else record.stable
            await self._traffic_changed(record, "set_traffic")
            return record

    async def promote(self, name: str, version: int = 0) -> ModelRecord:
        """Gives ``version`` (0: the canary) all traffic, then retires what the version policy no
        longer serves. Raises: NotFound, FailedPrecondition (no single canary)."""
        async with self._lock:
            record = self.record(name)
            if version and (version not in record.versions or record.versions[version].state != SERVING):
                raise NotFound(f"models/{name}/versions/{version} does not serve")
            self.router.promote(name, str(version) if version else None)
            await self._retire(record)
            await self._traffic_changed(record, "promote")
            return record

    async def rollback(self, name: str) -> ModelRecord:
        """All traffic back to the stable version; the other versions are retired.
        Raises: NotFound, FailedPrecondition (no stable version)."""
        async with self._lock:
            record = self.record(name)
            stable = int(self.router.rollback(name))
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
            observations = self._observer.observe(list(self.plan.placements))
            replan = self.replanner.replan(self.plan, self._demands(), self.profiles, observations)
            if replan.moves:
                await self._apply(replan)
                reasons = [f"{model}: {reason}" for model, reason in sorted(replan.reasons.items())]
                await self._placement_changed(replan, reasons)
            self.profiles = replan.profiles
            if replan.reasons and self._store is not None:
                await self._store.save_profiles(self.profiles.to_dict())
            return replan

    async def worker_restarted(self, worker_id: str, old: str, new: str) -> None:
        """Loads the replicas the plan has on a restarted worker and moves the router to its address."""
        async with self._lock:
            for (worker, model), hosted in list(self._hosted.items()):
                if worker != worker_id or not hosted:
                    continue
                name, number = model.name, model.version
                try:
                    await self._load(worker, model)
                except OpmlError as error:
                    log.error("re-loading %s on restarted worker %s failed: %s", model, worker_id, error.message)
                    continue
                with contextlib.suppress(NotFound):
                    await self.router.remove_replica(name, str(number), old)
                self.router.add_replica(name, str(number), new)
            await self._notify(events.PlacementChanged(placement=convert.placement(self),
                                                       reasons=[f"worker {worker_id} restarted at {new}"]),
                               "placement")

    # -- steps -----------------------------------------------------------------------------------

    async def _materialize(self, source: Source, bundle_uuid: str = "") -> tuple[Path, str]:
        if self._fetcher is None:
            if not source.model_dir:
                raise FailedPrecondition("this router has no bundle-store client; deploy from a model_dir")
            return local_directory(source), ""
        return await self._fetcher.fetch(source, bundle_uuid=bundle_uuid)

    def _check_kinds(self, config: ModelConfig) -> None:
        for index, kind in enumerate(config.pool_kinds):
            if kind not in self.fleet.kinds:
                raise InvalidArgument(f"pool_kinds[{index}]", f"must be a kind the fleet declares "
                                                              f"({', '.join(self.fleet.kinds)}), but got {kind!r}")
        if not any(self.fleet.workers_of(kind) for kind in config.pool_kinds):
            running = ", ".join(sorted({worker.kind.name for worker in self.fleet.workers}))
            raise FailedPrecondition(f"model {config.name} may run on {', '.join(config.pool_kinds)}, but this "
                                     f"router runs workers of {running} only (unavailable here: "
                                     f"{', '.join(self.pools.unavailable_kinds) or 'none'})")

    async def _profile(self, entry: VersionRecord, config: ModelConfig) -> None:
        """Profiles the version on the emptiest worker of each allowed kind that has workers.

        A kind that cannot host it (precision, room, a worker down) is skipped with its reason;
        a load that fails because of the bundle fails the deploy with the loader's reason.
        """
        model = ModelVersion(config.name, entry.version)
        skipped = []
        for kind in config.pool_kinds:
            workers = [w for w in self.fleet.workers_of(kind) if self.pools.get(w.id).alive]
            if not workers:
                continue
            used = Counter(worker_id for _, worker_id in self.plan.replicas())
            worker = min(workers, key=lambda w: (used[w.id], w.id))
            client = self.pools.client(worker.id)
            try:
                await client.load(config.name, path=Path(entry.directory), version=entry.version, profile=True)
            except _BUNDLE_FAULTS:
                raise
            except (FailedPrecondition, ResourceExhausted, Unavailable) as error:
                skipped.append(f"{kind}: {error.message}")
                continue
            try:
                profile = await client.profile(config.name, entry.version)
            finally:
                with contextlib.suppress(OpmlError):
                    await client.unload(config.name, entry.version)
            self.profiles.add(profile, replace=True)
            log.info("profiled %s on %s (%s): %s", model, kind, profile.precision,
                     {size: round(ms, 3) for size, ms in profile.batch_latency_ms.items()})
        if not any(self.profiles.get(model, kind) for kind in config.pool_kinds):
            raise FailedPrecondition(f"{model} could not be profiled on any allowed pool kind "
                                     f"({'; '.join(skipped) or 'no worker of them runs'})")
        if self._store is not None:
            await self._store.save_profiles(self.profiles.to_dict())

    def _demands(self, extra: ModelVersion | None = None) -> list[ModelDemand]:
        demands = []
        for record in self.models.values():
            for entry in record.versions.values():
                model = ModelVersion(record.name, entry.version)
                if entry.config is not None and (entry.state == SERVING or model == extra):
                    demands.append(ModelDemand(entry.config, entry.version, entry.config.expected_rate_rps))
        return demands

    async def _place(self, *, must_place: ModelVersion | None = None) -> None:
        """Re-plans with the current demands (no measurements: only new and dropped versions move)
        and applies the moves. Raises: FailedPrecondition when ``must_place`` finds no room."""
        replan = self.replanner.replan(self.plan, self._demands(extra=must_place), self.profiles, {})
        if must_place is not None and must_place in replan.plan.unplaced:
            raise FailedPrecondition(f"{must_place} cannot be placed: {replan.plan.unplaced[must_place]}")
        if replan.moves:
            await self._apply(replan)
            await self._placement_changed(replan, [f"{m}: {r}" for m, r in sorted(replan.reasons.items())])

    async def _apply(self, replan: Replan) -> None:
        """Carries out the moves in order; on a failure, undoes the ones done and re-raises."""
        check_moves(self.plan, replan.plan, replan.moves, self.fleet)
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
                self.router.set_model(name, self._policy(name))

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
        newest one's precision and batch cap (a worker changes a loaded version in place)."""
        hosted = self._hosted[worker, model]
        entry = self.models[model.name].versions[model.version]
        await self.pools.client(worker).load(model.name, path=Path(entry.directory), version=model.version,
                                             precision=hosted[-1].precision, instances=len(hosted),
                                             max_batch=hosted[-1].max_batch)

    def _route(self, replica: Replica) -> None:
        name = replica.model.name
        if name not in self.router.models():
            self.router.set_model(name, self._policy(name))
        self.router.add_replica(name, str(replica.model.version), self.pools.get(replica.worker).address)

    async def _remove(self, replica: Replica) -> None:
        """Retires one instance of the version, or unloads it with its last one."""
        key = (replica.worker, replica.model)
        hosted = self._hosted[key]
        hosted.remove(replica)
        if hosted:
            try:
                await self._load(*key)
            except Unavailable:  # a worker that is down comes back with what _hosted says
                pass
            except OpmlError:
                hosted.append(replica)
                raise
            return
        del self._hosted[key]
        name, number = replica.model.name, str(replica.model.version)
        with contextlib.suppress(NotFound):
            await self.router.remove_replica(name, number, self.pools.get(replica.worker).address)
        with contextlib.suppress(NotFound, Unavailable):
            await self.pools.client(replica.worker).unload(name, replica.model.version)

    def _policy(self, name: str) -> ModelPolicy:
        record = self.models[name]
        newest = max((e for e in record.versions.values() if e.config is not None), key=lambda e: e.version)
        placed = [s for m, s in self.plan.placements.items() if m.name == name]
        replicas = sum(len(s.workers) for s in placed)
        rows = sum(len(s.workers) * s.option.max_batch for s in placed)  # what the planned batch caps take
        limits = {"max_concurrency": max(8, 2 * rows), "max_queue": 4 * max(8, 2 * rows)} if rows else {}
        return ModelPolicy.for_model(newest.config, replicas=max(1, replicas), **limits)  # type: ignore[arg-type]

    async def _retire(self, record: ModelRecord) -> None:
        """Drops the serving versions that neither the stable one's version policy keeps nor take traffic."""
        stable = self.router.describe(record.name)["stable"]
        record.stable = int(stable) if stable else None
        serving = [entry.version for entry in record.serving()]
        if record.stable is None or not serving:
            return
        policy = record.versions[record.stable].config.version_policy  # type: ignore[union-attr]
        keep = set(policy.select(serving)) | {record.stable} | {int(v) for v in self.traffic_percent(record.name)}
        for number in serving:
            if number not in keep:
                self._forget(record, number)
        try:
            await self._place()
        except OpmlError as error:  # the retired versions keep their replicas until a later re-plan
            log.warning("unloading retired versions of %s failed: %s", record.name, error.message)
        if self._store is not None:
            await self._store.save_profiles(self.profiles.to_dict())

    def _forget(self, record: ModelRecord, number: int) -> None:
        """Drops a retired version: its record, profiles and measurements (the next re-plan unloads it)."""
        del record.versions[number]
        model = ModelVersion(record.name, number)
        self.profiles = ProfileBook(profile for profile in self.profiles if profile.model != model)
        self._observer.forget(model)

    async def _restore(self) -> None:
        """Rebuilds the stored deployments on fresh workers: bundles fetched again where missing,
        placement from the stored profiles, traffic as it was."""
        if self._store is None:
            return
        records, profiles = await self._store.load()
        self._last_version = await self._store.load_last_versions()
        if not records:
            return
        async with self._lock:
            self.profiles = ProfileBook.from_dict(profiles)
            for record in records:
                for entry in record.versions.values():
                    if entry.state == DEPLOYING:
                        entry.state, entry.reason = FAILED, "the deploy was interrupted by a restart of the router"
                for entry in record.serving():
                    try:
                        directory, _ = await self._materialize(entry.source, entry.bundle_uuid)
                        entry.directory = str(directory)
                        entry.config = (await asyncio.to_thread(load_bundle, directory)).config
                    except OpmlError as error:
                        entry.state, entry.reason = FAILED, f"not restored: {error.message}"
                self.models[record.name] = record
            try:
                await self._place()
            except OpmlError as error:
                log.error("restoring the placement failed: %s", error.message)
            for record in self.models.values():
                for entry in record.serving():
                    if ModelVersion(record.name, entry.version) not in self.plan.placements:
                        entry.state = FAILED
                        entry.reason = "not placed after a restart: " + self.plan.unplaced.get(
                            ModelVersion(record.name, entry.version), "the move failed")
                if record.name in self.router.models():
                    with contextlib.suppress(OpmlError):
                        self._restore_traffic(record)
                await self._save(record)
            log.info("restored deployments: %s", sorted(self.models))

    def _restore_traffic(self, record: ModelRecord) -> None:
        """The stored split, with the stored stable version as the router's stable one (a rollback
        after a restart goes where it went before)."""
        name, weights = record.name, {v: w for v, w in record.traffic.items() if w > 0}
        if record.stable is not None:
            self.router.promote(name, str(record.stable))
        others = [v for v in weights if v != str(record.stable)]
        if len(others) == 1 and str(record.stable) in weights:
            self.router.start_canary(name, others[0], 100.0 * weights[others[0]] / sum(weights.values()))
        elif others:
            self.router.set_traffic(name, weights)

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

    async def _give_version(self, name: str, number: int) -> None:
        """Remembers ``number`` as given (in Redis before the deploy acts, so a restart never gives it again)."""
        if number > self._last_version.get(name, 0):
            self._last_version[name] = number
            if self._store is not None:
                await self._store.save_last_version(name, number)

    async def _save(self, record: ModelRecord) -> None:
        if record.name in self.router.models():
            record.traffic = {v: float(w) for v, w in self.router.describe(record.name)["traffic"].items()}
        if self._store is not None:
            await self._store.save_model(record)

    async def _traffic_changed(self, record: ModelRecord, cause: str) -> None:
        await self._save(record)
        await self._notify(events.TrafficChanged(model=record.name, traffic_percent=self.traffic_percent(record.name),
                                                 stable_version=record.stable or 0, cause=cause), record.name)

    async def _placement_changed(self, replan: Replan, reasons: list[str]) -> None:
        added = sum(isinstance(a, AddReplica) for a in replan.moves)
        removed = sum(isinstance(a, RemoveReplica) for a in replan.moves)
        await self._notify(events.PlacementChanged(placement=convert.placement(self), reasons=reasons,
                                                   replicas_added=added, replicas_removed=removed), "placement")

    async def report_failure(self, source: Source, error: OpmlError, *, version: int = 0) -> None:
        """Publishes DeployFailed for a deploy that failed before its bundle named the model."""
        await self._failed(None, version, source, error)

    async def _failed(self, name: str | None, version: int, source: Source, error: OpmlError) -> None:
        log.warning("deploy of %s failed: %s", source, error.message)
        message = events.DeployFailed(model=name or "", version=version, code=error.code, reason=error.message)
        convert.set_source(message, source)
        await self._notify(message, name or str(source))

    async def _notify(self, message: Message, subject: str) -> None:
        if self._emit is not None:
            await self._emit(message, subject)
