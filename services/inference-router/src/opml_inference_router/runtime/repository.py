"""The model versions one worker hosts, within what its pool kind declares (slots and memory).

A load reads the bundle, checks the model may run on this kind, converts it to the precision they
share, builds and checks the session, warms it at its largest batch and measures what that added
to the worker's memory; only a replica that fits is swapped in (replacing the same version if it
was loaded), so a failed load leaves every served model as it was. Loads are serialized; they run
off the event loop, which keeps serving meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
from opml_common.errors import FailedPrecondition, InvalidArgument, NotFound, OpmlError, ResourceExhausted

from opml_inference_router.placement.config import ModelVersion, PoolKind
from opml_inference_router.runtime.batcher import DynamicBatcher
from opml_inference_router.runtime.bundle import ModelBundle, load_bundle
from opml_inference_router.runtime.metrics import WorkerMetrics
from opml_inference_router.runtime.profiler import ProfileReport, profile_replica, synthetic_inputs
from opml_inference_router.runtime.replica import Replica
from opml_inference_router.runtime.session import (
    CALIBRATION_FILE,
    build_session,
    check_signature,
    choose_precision,
    convert,
)

log = logging.getLogger(__name__)
MIB = 1024 * 1024


@dataclass
class Served:
    """A ready replica and its batcher; ``profile`` when it was profiled on load."""

    replica: Replica
    batcher: DynamicBatcher
    profile: ProfileReport | None = None


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

    ``threads`` is each replica's intra-op thread count (its share of the worker's cores).
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
        if not version.isdigit() or int(version) < 1:
            raise InvalidArgument("model_version", f"must be a positive integer or empty (the newest), "
                                                   f"but got {version!r}")
        served = versions.get(int(version))
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
        return sum(len(versions) for versions in self._served.values())

    @property
    def memory_used_mib(self) -> float:
        return sum(s.replica.memory_mib for versions in self._served.values() for s in versions.values())

    # -- loading -----------------------------------------------------------------------------

    async def load(self, name: str, *, path: str | Path | None = None, version: int | None = None,
                   precision: str | None = None, profile: bool = False) -> list[Served]:
        """Loads ``name`` from ``path`` (default: ``<models_dir>/<name>``): ``version`` alone, else the
        versions its policy picks; with ``profile``, measures each before it serves.

        Raises:
            NotFound: no such bundle directory, ONNX file or version.
            InvalidArgument: a bad config, a config naming another model, a graph that does not match the
                config, or an ONNX file onnxruntime refuses (the message is onnxruntime's reason).
            FailedPrecondition: the model may not run on this kind, or they share no precision.
            ResourceExhausted: the worker's slots or memory would be exceeded.
        """
        async with self._lock:
            try:
                served = await self._load(name, path, version, precision, profile)
            except OpmlError as error:
                self._failed[name] = error.message
                log.warning("load of %s failed: %s", name, error.message)
                raise
            self._failed.pop(name, None)
            return served

    async def _load(self, name: str, path: str | Path | None, version: int | None, precision: str | None,
                    profile: bool) -> list[Served]:
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
        replaced = [v for v in files if v in current]
        free_slots = self.kind.slots - self.slots_used + len(replaced)
        if len(files) > free_slots:
            raise ResourceExhausted(
                f"loading {len(files)} version(s) of {name} needs {len(files)} slot(s), but this {self.kind.name} "
                f"worker has {free_slots} free of {self.kind.slots} ({self._occupants()}); unload a model first")
        free_mib = self.kind.memory_mib - self.memory_used_mib + sum(current[v].replica.memory_mib for v in replaced)
        weights_mib = sum(f.stat().st_size for f in files.values()) / MIB
        if weights_mib > free_mib:
            raise ResourceExhausted(f"{name}'s ONNX files alone take {weights_mib:.1f} MiB, but this "
                                    f"{self.kind.name} worker has {free_mib:.1f} MiB free of {self.kind.memory_mib}")
        built: dict[int, Served] = {}
        for number, file in sorted(files.items()):
            replica = await asyncio.to_thread(self._build, bundle, ModelVersion(name, number), file, chosen)
            if replica.memory_mib > free_mib:
                raise ResourceExhausted(f"{replica.model} takes {replica.memory_mib:.1f} MiB once loaded, but this "
                                        f"{self.kind.name} worker has {free_mib:.1f} MiB free of "
                                        f"{self.kind.memory_mib}")
            free_mib -= replica.memory_mib
            report = (await asyncio.to_thread(profile_replica, replica, repeats=self._profile_repeats)
                      if profile else None)
            built[number] = Served(replica, DynamicBatcher(replica, self._metrics.for_replica(name, number)), report)
        for served in built.values():
            await served.batcher.start()
        old = [current[v] for v in replaced]
        self._served.setdefault(name, {}).update(built)
        self._update_gauges()
        for served in old:
            await served.batcher.stop()
        log.info("loaded %s versions %s on %s in %s (%.1f MiB)", name, sorted(built), self.kind.name, chosen,
                 sum(s.replica.memory_mib for s in built.values()))
        return list(built.values())

    def _bundle_dir(self, name: str, path: str | Path | None) -> Path:
        if path:
            return Path(path)
        if self._models_dir is None:
            raise InvalidArgument("parameters[path]", f"is required: this worker has no models directory to find "
                                                      f"{name} in")
        return self._models_dir / name

    def _build(self, bundle: ModelBundle, model: ModelVersion, file: Path, precision: str) -> Replica:
        """Converts, builds, checks and warms one replica, measuring the memory it added (blocking)."""
        before = _resident_mib()
        data = convert(file, precision, bundle.config, calibration=bundle.directory / CALIBRATION_FILE)
        session = build_session(data, self.kind, threads=self._threads, source=str(file))
        check_signature(session, bundle.config)
        replica = Replica(model, bundle.config, self.kind, precision, session)
        replica.run(synthetic_inputs(bundle.config, replica.max_batch, np.random.default_rng(0)))
        replica.memory_mib = max(_resident_mib() - before, len(data) / MIB)
        return replica

    def _occupants(self) -> str:
        names = [f"{name} v{v}" for name, versions in sorted(self._served.items()) for v in sorted(versions)]
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
