"""Performance models of a served model version's serving configurations, per pool kind: what the
router measured (:mod:`~opml_inference_router.runtime.perfsample`), kept, and what it predicts
from them (Iqbal, Kotthoff, Jamshidi, OpML '19).

A kind with at least ``min_measured`` measurements of the version has its own
:class:`~opml_common.perfmodel.PerformanceModel`. A kind with fewer (a few target samples) is
predicted by the model of the version's most measured kind, scaled by the median ratio its own
measurements show to that model (:class:`~opml_common.perfmodel.ScaleShift`: the lowest transfer
error at 5 and 10 samples in docs/benchmarks.md). Fitted models are kept until the measurements
they were learnt on change, so a search asking for one configuration at a time (the
automl-controller's ServingConfigSurrogate trials) pays for a fit once.

Measurements run on the router's machine, on a thread, one request at a time: the session code of
the kind (its execution provider, int8 emulation, batches padded to its fixed shapes) on this
machine's cores. On a fleet whose kinds are other machines they measure this one (measuring on a
worker of the kind is not built). Kept in Redis (``<prefix>inference-router:serving-samples``,
one field per version and kind), so predictions survive a restart of the router.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from opml_common.errors import FailedPrecondition, InvalidArgument, NotFound
from opml_common.perfmodel import PerformanceModel, Sample, ScaleShift, ServingConfig
from opml_inference_router.control.state import SERVING, ModelRecord
from opml_inference_router.placement import Fleet, ServingTable
from opml_inference_router.runtime import load_bundle
from opml_inference_router.runtime.perfsample import measure

MIN_MEASURED = 20

log = logging.getLogger(__name__)


class SampleStore(Protocol):
    """Where measurements are kept (:class:`~.state.DeploymentStore`)."""

    async def save_serving_samples(self, key: str, samples: list[dict[str, Any]]) -> None: ...
    async def load_serving_samples(self, key: str) -> list[dict[str, Any]]: ...


@dataclass(frozen=True)
class Fit:
    """Which performance model answered: ``measured`` (learnt on the kind's own measurements) or
    ``transferred`` (learnt on ``learned_on``, scaled by the kind's ``target_samples``)."""

    method: str
    learned_on: str
    source_samples: int
    target_samples: int

    def __str__(self) -> str:
        if self.method == "measured":
            return f"performance model of {self.target_samples} {self.learned_on} measurements"
        return (f"performance model of {self.source_samples} {self.learned_on} measurements, transferred with "
                f"{self.target_samples} of the kind")


class ServingModels:
    """Measures and predicts serving configurations of the versions ``models`` holds.

    ``models``: the deployment manager's records (read, never changed); ``fleet`` its kinds;
    ``unavailable``: kinds whose execution provider this machine lacks (not measured here).
    ``on_measured(model, version)``: awaited after each measurement is kept (the deployment manager
    sets it: a measurement can change the serving configuration placement chooses).
    """

    def __init__(self, *, models: dict[str, ModelRecord], fleet: Fleet, store: SampleStore | None = None,
                 unavailable: Sequence[str] = (), min_measured: int = MIN_MEASURED) -> None:
        if min_measured < 2:
            raise InvalidArgument("min_measured", f"must be >= 2, but got {min_measured}")
        self._models, self._fleet, self._store = models, fleet, store
        self._unavailable = set(unavailable)
        self.min_measured = min_measured
        self._samples: dict[tuple[str, int, str], list[Sample]] = {}
        self._fitted: dict[tuple[str, int, str], tuple[tuple, Any, Fit]] = {}
        self._lock = asyncio.Lock()  # one measurement at a time: each takes the machine's cores
        self.on_measured: Callable[[str, int], Awaitable[None]] | None = None

    async def measure(self, model: str, version: int, kind: str, configs: Sequence[ServingConfig], *,
                      runs: int = 15, passes: int = 3) -> list[Sample]:
        """Measures ``configs`` of the version on ``kind`` and keeps them (a configuration measured
        before is replaced); returns every measurement kept for the version on the kind.

        Raises:
            NotFound: no such model or version.
            FailedPrecondition: the version does not serve; the kind's provider is not on this
                machine; a configuration's precision is not one the kind runs.
            InvalidArgument: ``kind`` is not a kind of the fleet.
        """
        directory = self._directory(model, version)
        pool_kind = self._kind(kind)
        if kind in self._unavailable:
            raise FailedPrecondition(f"pool kind {kind} runs on {pool_kind.execution_provider}, which this machine "
                                     f"lacks; its configurations cannot be measured here")
        bundle = await asyncio.to_thread(load_bundle, directory, flat_version=version)
        path = bundle.select(version)[version]
        async with self._lock:
            measured = await asyncio.to_thread(measure, Path(path), bundle.config, pool_kind, list(configs),
                                               runs=runs, passes=passes)
            kept = {s.config: s for s in await self.samples(model, version, kind)}
            kept.update((s.config, s) for s in measured)
            samples = list(kept.values())
            self._samples[model, version, kind] = samples
            if self._store is not None:
                await self._store.save_serving_samples(_key(model, version, kind), [_to_dict(s) for s in samples])
        if self.on_measured is not None:
            await self.on_measured(model, version)
        return samples

    async def samples(self, model: str, version: int, kind: str) -> list[Sample]:
        """The measurements kept for the version on ``kind`` (none: empty)."""
        key = (model, version, kind)
        if key not in self._samples and self._store is not None:
            self._samples[key] = [_from_dict(d) for d in await self._store.load_serving_samples(_key(*key))]
        return self._samples.get(key, [])

    async def predict(self, model: str, version: int, kind: str,
                      configs: Sequence[ServingConfig]) -> tuple[list[Sample], Fit]:
        """Predicted latency of each of ``configs`` (as samples, in order) and the model that predicted them.

        Raises:
            NotFound: no such model or version.
            FailedPrecondition: the version does not serve, or is measured on no kind with
                ``min_measured`` measurements, or (for a kind with fewer) has no measurement on ``kind``.
            InvalidArgument: ``kind`` is not a kind of the fleet.
        """
        self._directory(model, version)
        self._kind(kind)
        return await self._predict(model, version, kind, configs)

    async def table(self, model: str, version: int, kind: str, configs: Sequence[ServingConfig]) -> ServingTable | None:
        """The predicted batch latency of each of ``configs`` for placement (:mod:`~.placement.serving`),
        whatever the version's state (a version placed while it is deployed or restored); None when
        nothing predicts the kind (too few measurements, as :meth:`predict` refuses)."""
        try:
            predictions, fit = await self._predict(model, version, kind, configs)
        except FailedPrecondition as why:
            log.debug("no serving-configuration predictions of %s v%d on %s: %s", model, version, kind, why.message)
            return None
        return ServingTable({p.config: p.latency_ms for p in predictions}, str(fit))

    async def _predict(self, model: str, version: int, kind: str,
                       configs: Sequence[ServingConfig]) -> tuple[list[Sample], Fit]:
        target = await self.samples(model, version, kind)
        if len(target) >= self.min_measured:
            learner, fit = await self._fitted_model(model, version, kind, target, None)
        else:
            counts = {other: len(await self.samples(model, version, other)) for other in self._fleet.kinds}
            source = max((k for k in counts if k != kind), key=lambda k: (counts[k], k), default=None)
            if source is None or counts[source] < self.min_measured:
                raise FailedPrecondition(
                    f"models/{model}/versions/{version} has {len(target)} measurements on {kind} and no kind with "
                    f"{self.min_measured}: measure {kind} (MeasureServingConfigs) with {self.min_measured} "
                    f"configurations, or another kind with {self.min_measured} and {kind} with a few")
            if not target:
                raise FailedPrecondition(
                    f"models/{model}/versions/{version} has no measurement on {kind} to transfer its {source} model "
                    f"with: measure a few {kind} configurations (MeasureServingConfigs; 5 to 10 do)")
            learner, fit = await self._fitted_model(model, version, kind, target,
                                                    (source, await self.samples(model, version, source)))
        mflop = target[0].mflop_per_row
        points = [Sample(model, mflop, config) for config in configs]
        latencies = learner.predict_ms(points)
        return [Sample(model, mflop, p.config, float(ms)) for p, ms in zip(points, latencies, strict=True)], fit

    async def _fitted_model(self, model: str, version: int, kind: str, target: list[Sample],
                            source: tuple[str, list[Sample]] | None) -> tuple[Any, Fit]:
        """The fitted model, learnt again only when its measurements changed (fitted on a thread)."""
        stamp = (tuple(s.latency_ms for s in target), source[0] if source else "",
                 tuple(s.latency_ms for s in source[1]) if source else ())
        cached = self._fitted.get((model, version, kind))
        if cached is not None and cached[0] == stamp:
            return cached[1], cached[2]

        def fit() -> tuple[Any, Fit]:
            if source is None:
                return (PerformanceModel(environment=kind).fit(target),
                        Fit("measured", kind, len(target), len(target)))
            name, samples = source
            base = PerformanceModel(environment=name).fit(samples)
            return ScaleShift(base).fit(target), Fit("transferred", name, len(samples), len(target))

        learner, described = await asyncio.to_thread(fit)
        self._fitted[model, version, kind] = (stamp, learner, described)
        return learner, described

    def _directory(self, model: str, version: int) -> str:
        record = self._models.get(model)
        if record is None or version not in record.versions:
            raise NotFound(f"models/{model}/versions/{version} is not deployed"
                           + (f" (it has versions {sorted(record.versions)})" if record else ""))
        entry = record.versions[version]
        if entry.state != SERVING:
            raise FailedPrecondition(f"models/{model}/versions/{version} is {entry.state}, not SERVING")
        return entry.directory

    def _kind(self, kind: str):
        pool_kind = self._fleet.kinds.get(kind)
        if pool_kind is None:
            raise InvalidArgument("pool_kind", f"must be a pool kind of the fleet ({', '.join(self._fleet.kinds)}), "
                                               f"but got {kind!r}")
        return pool_kind


def _key(model: str, version: int, kind: str) -> str:
    return f"{model}/{version}/{kind}"


def _to_dict(sample: Sample) -> dict[str, Any]:
    return {"mflop_per_row": sample.mflop_per_row, "latency_ms": sample.latency_ms, **vars(sample.config),
            "model": sample.model}


def _from_dict(data: dict[str, Any]) -> Sample:
    config = ServingConfig(data["batch"], data["threads"], data["opt_level"], data["execution_mode"],
                           data["precision"])
    return Sample(data["model"], data["mflop_per_row"], config, data["latency_ms"])
