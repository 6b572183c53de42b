"""The model versions one worker hosts, within what its pool kind declares (slots and memory).

A load reads the bundle, checks the model may run on this kind, converts it to the precision they
share, builds and checks the session, warms it at its largest batch and measures what that added
to the worker's memory; only a replica that fits is swapped in (replacing the same version if it
was loaded), so a failed load leaves every served model as it was. Loads are serialized; they run
off the event loop, which keeps serving meanwhile.

A version may run as several *instances* (Triton's ``instance_group`` count): sessions of the same
model, each on its own thread and slot, fed by the version's one batcher. A load that names a
loaded version with ``instances`` or ``max_batch`` and keeps its precision and session options
changes them in place: it builds or retires only the instances that differ and re-caps the
batcher, without a reload.

Each loaded version has its own session options (:class:`SessionSettings`: intra-op threads,
graph optimization level, execution mode; the worker's defaults unless the load names others), so
two models on one worker can run with different ones; threads never exceed the slot's share.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil

from opml_common.errors import FailedPrecondition, InvalidArgument, NotFound, OpmlError, ResourceExhausted, brief
from opml_inference_router.placement.fleet_config import ModelVersion, PoolKind
from opml_inference_router.runtime.batcher import DynamicBatcher
from opml_inference_router.runtime.bundle import ModelBundle, load_bundle
from opml_inference_router.runtime.metrics import WorkerMetrics
from opml_inference_router.runtime.profiler import ProfileReport, profile_replica, synthetic_inputs
from opml_inference_router.runtime.replica import Replica
from opml_inference_router.runtime.session import (
    CALIBRATION_FILE,
    EXECUTION_MODES,
    OPT_LEVELS,
    SessionSettings,
    build_session,
    check_signature,
    choose_precision,
    convert,
)
from opml_inference_router_contract.model_config import version_number

log = logging.getLogger(__name__)
MIB = 1024 * 1024


@dataclass
class Served:
    """A ready replica and its batcher; ``profile`` when it was profiled on load; ``settings`` the
    session options its instances were built with."""

    replica: Replica
    batcher: DynamicBatcher
    profile: ProfileReport | None
    settings: SessionSettings

    @property
    def instances(self) -> int:
        """Sessions serving the version (slots it takes)."""
        return len(self.batcher.instances)

    @property
    def memory_mib(self) -> float:
        return sum(instance.memory_mib for instance in self.batcher.instances)


@dataclass(frozen=True)
class IndexEntry:
    """A row of RepositoryIndex: a served version (READY) or a model whose last load failed (UNAVAILABLE)."""

    name: str
    version: str
    state: str
    reason: str = ""


def _resident_mib() -> float:
    return psutil.Process().memory_info().rss / MIB


class ModelRepository:
    """Loads, serves and unloads replicas on a worker of ``kind``.

    ``threads`` is each replica's intra-op thread count by default and the most a load may ask for
    (its slot's share of the worker's cores).
    """

    def __init__(self, kind: PoolKind, *, metrics: WorkerMetrics, threads: int, models_dir: Path | None = None,
                 profile_repeats: int = 20) -> None:
        self.kind = kind
        self._metrics = metrics
        self._threads = threads
        self._models_dir = models_dir
        self._profile_repeats = profile_repeats
        self._served: dict[str, dict[int, Served]] = {}
        self._failed: dict[str, str] = {}
        self._lock = asyncio.Lock()

    # -- serving -----------------------------------------------------------------------------

    def get(self, name: str, version: str = "") -> Served:
        """The replica serving ``name`` at ``version`` ("" = the newest loaded).

        Raises:
            NotFound: the model or that version is not loaded here.
            InvalidArgument: ``version`` is not a positive integer.
        """
        versions = self._served.get(name)
        if not versions:
            loaded = ", ".join(sorted(self._served)) or "none"
            raise NotFound(f"model {name!r} is not loaded on this worker (loaded: {loaded})")
        if not version:
            return versions[max(versions)]
        number = version_number(version)
        if number is None:
            raise InvalidArgument("model_version", f"must be a positive integer or empty (the newest), "
                                                   f"but got {brief(version)}")
        served = versions.get(number)
        if served is None:
            raise NotFound(f"version {version} of model {name!r} is not loaded on this worker "
                           f"(loaded versions: {', '.join(map(str, sorted(versions)))})")
        return served

    def versions(self, name: str) -> list[int]:
        return sorted(self._served.get(name, {}))

    def index(self) -> list[IndexEntry]:
        entries = [IndexEntry(name, str(version), "READY")
                   for name, versions in sorted(self._served.items()) for version in sorted(versions)]
        entries += [IndexEntry(name, "", "UNAVAILABLE", reason) for name, reason in sorted(self._failed.items())]
        return entries

    @property
    def slots_used(self) -> int:
        return sum(s.instances for versions in self._served.values() for s in versions.values())

    @property
    def memory_used_mib(self) -> float:
        return sum(s.memory_mib for versions in self._served.values() for s in versions.values())

    # -- loading -----------------------------------------------------------------------------

    async def load(self, name: str, *, path: str | Path | None = None, version: int | None = None,
                   precision: str | None = None, profile: bool = False, instances: int | None = None,
                   max_batch: int | None = None, threads: int | None = None, opt_level: str | None = None,
                   execution_mode: str | None = None) -> list[Served]:
        """Loads ``name`` from ``path`` (default: ``<models_dir>/<name>``): ``version`` alone, else the
        versions its policy picks; with ``profile``, measures each before it serves. Each version runs
        ``instances`` sessions (default 1) and batches up to ``max_batch`` rows (default: all the
        replica takes). When ``version`` is loaded in the same precision and ``instances`` or
        ``max_batch`` is given (without ``profile``), they are changed in place instead.
        ``threads``, ``opt_level``, ``execution_mode``: the sessions' options (each left out: the
        loaded version's, else the worker's default); other ones than a loaded version's reload it
        (the new sessions are built beside the serving ones and swapped in).

        Raises:
            NotFound: no such bundle directory, ONNX file or version.
            InvalidArgument: a bad config, a config naming another model, a graph that does not match the
                config, or an ONNX file onnxruntime refuses (the message is onnxruntime's reason).
            FailedPrecondition: the model may not run on this kind, or they share no precision.
            ResourceExhausted: the worker's slots or memory would be exceeded.
            InvalidArgument: ``instances`` or ``max_batch`` below 1; ``threads`` below 1 or above the
                slot's share; an unknown ``opt_level`` or ``execution_mode``.
        """
        for field, value in (("instances", instances), ("max_batch", max_batch), ("threads", threads)):
            if value is not None and value < 1:
                raise InvalidArgument(field, f"must be >= 1, but got {value}")
        if threads is not None and threads > self._threads:
            raise InvalidArgument("threads", f"must be at most {self._threads} (a slot's share of this "
                                             f"{self.kind.name} worker's cores), but got {threads}")
        for field, value, allowed in (("opt_level", opt_level, OPT_LEVELS), ("execution_mode", execution_mode,
                                                                             EXECUTION_MODES)):
            if value is not None and value not in allowed:
                raise InvalidArgument(field, f"must be one of {', '.join(allowed)}, but got {value!r}")
        asked = {"threads": threads, "opt_level": opt_level, "execution_mode": execution_mode}
        async with self._lock:
            try:
                served = await self._load(name, path, version, precision, profile, instances, max_batch, asked)
            except OpmlError as error:
                self._failed[name] = error.message
                log.warning("load of %s failed: %s", name, error.message)
                raise
            self._failed.pop(name, None)
            return served

    async def _load(self, name: str, path: str | Path | None, version: int | None, precision: str | None,
                    profile: bool, instances: int | None, max_batch: int | None,
                    asked: dict[str, object]) -> list[Served]:
        bundle = await asyncio.to_thread(load_bundle, self._bundle_dir(name, path), flat_version=version or 1)
        config = bundle.config
        if config.name != name:
            raise InvalidArgument("model_name", f"is {name!r}, but the bundle's model.yaml names {config.name!r}")
        if self.kind.name not in config.pool_kinds:
            raise FailedPrecondition(f"model {name} may run on pool kinds {', '.join(config.pool_kinds)}, "
                                     f"not on this worker's {self.kind.name}")
        chosen = choose_precision(config, self.kind, precision)
        files = bundle.select(version)
        current = self._served.get(name, {})
        loaded = current.get(version) if version is not None else None
        base = loaded.settings if loaded is not None else SessionSettings(self._threads)
        settings = SessionSettings(**{**vars(base), **{k: v for k, v in asked.items() if v is not None}})
        if (loaded is not None and (instances or max_batch) and not profile and loaded.replica.precision == chosen
                and loaded.settings == settings):
            return [await self._update(loaded, bundle, files[version], instances or loaded.instances, max_batch)]
        count = instances or 1
        replaced = [v for v in files if v in current]
        free_slots = self.kind.slots - self.slots_used + sum(current[v].instances for v in replaced)
        if len(files) * count > free_slots:
            each = f" with {count} instances each" if count > 1 else ""
            raise ResourceExhausted(
                f"loading {len(files)} version(s) of {name}{each} needs {len(files) * count} slot(s), but this "
                f"{self.kind.name} worker has {free_slots} free of {self.kind.slots} ({self._occupants()}); "
                f"unload a model first")
        free_mib = self.kind.memory_mib - self.memory_used_mib + sum(current[v].memory_mib for v in replaced)
        weights_mib = count * sum(f.stat().st_size for f in files.values()) / MIB
        if weights_mib > free_mib:
            raise ResourceExhausted(f"{name}'s ONNX files alone take {weights_mib:.1f} MiB, but this "
                                    f"{self.kind.name} worker has {free_mib:.1f} MiB free of {self.kind.memory_mib}")
        built: dict[int, Served] = {}
        for number, file in sorted(files.items()):
            data = await asyncio.to_thread(convert, file, chosen, config,
                                           calibration=bundle.directory / CALIBRATION_FILE)
            replicas = []
            for _ in range(count):
                replica = await asyncio.to_thread(self._instance, bundle, ModelVersion(name, number), file, data,
                                                  chosen, settings)
                self._check_memory(replica, free_mib)
                free_mib -= replica.memory_mib
                replicas.append(replica)
            report = (await asyncio.to_thread(profile_replica, replicas[0], repeats=self._profile_repeats)
                      if profile else None)
            batcher = DynamicBatcher(replicas[0], self._metrics.for_replica(name, number))
            for replica in replicas[1:]:
                batcher.add_instance(replica)
            if max_batch is not None:
                batcher.set_max_batch(max_batch)
            built[number] = Served(replicas[0], batcher, report, settings)
        for served in built.values():
            await served.batcher.start()
        old = [current[v] for v in replaced]
        self._served.setdefault(name, {}).update(built)
        self._update_gauges()
        for served in old:
            await served.batcher.stop()
        log.info("loaded %s versions %s x%d on %s in %s with %s (%.1f MiB)", name, sorted(built), count,
                 self.kind.name, chosen, settings, sum(s.memory_mib for s in built.values()))
        return list(built.values())

    async def _update(self, served: Served, bundle: ModelBundle, file: Path, instances: int,
                      max_batch: int | None) -> Served:
        """Changes a serving version's instance count and batch cap in place (no reload)."""
        model, have = served.replica.model, served.instances
        if instances > have:
            free_slots = self.kind.slots - self.slots_used
            if instances - have > free_slots:
                raise ResourceExhausted(
                    f"{model} needs {instances - have} more slot(s) for {instances} instances, but this "
                    f"{self.kind.name} worker has {free_slots} free of {self.kind.slots} ({self._occupants()})")
            free_mib = self.kind.memory_mib - self.memory_used_mib
            data = await asyncio.to_thread(convert, file, served.replica.precision, bundle.config,
                                           calibration=bundle.directory / CALIBRATION_FILE)
            added = []
            for _ in range(instances - have):
                replica = await asyncio.to_thread(self._instance, bundle, model, file, data, served.replica.precision,
                                                  served.settings)
                self._check_memory(replica, free_mib)
                free_mib -= replica.memory_mib
                added.append(replica)
            for replica in added:
                served.batcher.add_instance(replica)
        elif instances < have:
            await served.batcher.retire(have - instances)
        if max_batch is not None:
            served.batcher.set_max_batch(max_batch)
        self._update_gauges()
        log.info("%s on %s now runs %d instance(s), batches up to %d rows", model, self.kind.name, served.instances,
                 served.batcher.max_batch)
        return served

    def _check_memory(self, replica: Replica, free_mib: float) -> None:
        if replica.memory_mib > free_mib:
            raise ResourceExhausted(f"{replica.model} takes {replica.memory_mib:.1f} MiB once loaded, but this "
                                    f"{self.kind.name} worker has {free_mib:.1f} MiB free of {self.kind.memory_mib}")

    def _bundle_dir(self, name: str, path: str | Path | None) -> Path:
        if path:
            return Path(path)
        if self._models_dir is None:
            raise InvalidArgument("parameters[path]", f"is required: this worker has no models directory to find "
                                                      f"{name} in")
        return self._models_dir / name

    def _instance(self, bundle: ModelBundle, model: ModelVersion, file: Path, data: bytes, precision: str,
                  settings: SessionSettings) -> Replica:
        """Builds, checks and warms one instance from the converted model, measuring the memory it added
        (blocking)."""
        before = _resident_mib()
        session = build_session(data, self.kind, threads=settings.threads, source=str(file), folder=file.parent,
                                opt_level=settings.opt_level, execution_mode=settings.execution_mode)
        check_signature(session, bundle.config)
        replica = Replica(model, bundle.config, self.kind, precision, session)
        replica.run(synthetic_inputs(bundle.config, replica.max_batch, np.random.default_rng(0)))
        replica.memory_mib = max(_resident_mib() - before, len(data) / MIB)
        return replica

    def _occupants(self) -> str:
        names = [f"{name} v{v}" + (f" x{s.instances}" if s.instances > 1 else "")
                 for name, versions in sorted(self._served.items()) for v, s in sorted(versions.items())]
        return "in use by " + ", ".join(names) if names else "none in use"

    def _update_gauges(self) -> None:
        self._metrics.replicas.set(self.slots_used)
        self._metrics.memory.set(self.memory_used_mib)

    # -- unloading ---------------------------------------------------------------------------

    async def unload(self, name: str, version: int | None = None) -> None:
        """Stops serving ``name`` (one ``version``, else all); queued requests finish first.

        Raises:
            NotFound: the model or that version is not loaded.
        """
        async with self._lock:
            self._failed.pop(name, None)
            versions = self._served.get(name)
            if not versions or (version is not None and version not in versions):
                what = f"version {version} of model {name!r}" if version is not None else f"model {name!r}"
                raise NotFound(f"{what} is not loaded on this worker")
            numbers = [version] if version is not None else list(versions)
            removed = [versions.pop(number) for number in numbers]
            if not versions:
                del self._served[name]
            self._update_gauges()
            for served in removed:
                await served.batcher.stop()
                self._metrics.forget(name, served.replica.model.version)

    async def close(self) -> None:
        """Stops every replica (worker shutdown)."""
        for name in list(self._served):
            await self.unload(name)
