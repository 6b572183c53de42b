"""A rollout's measures from every router replica (``OPML_INFERENCE_ROUTER_REPLICATED``).

Every replica serves inference, so a rollout's versions answer requests in each, but the analysis
runs in the leader (:mod:`.progressive`): judged on the leader's own router alone, it saw a share of
the traffic, and none of a shadow step's comparisons a follower made. Each follower therefore
(:class:`MeasuresReporter`), for every RUNNING rollout in the store, mirrors what the rollout's
current step has in force (as the leader does) and every :data:`REPORT_S` moves what its router
measured of the model's versions (requests, errors, the latency histogram, the mirror's comparisons)
to a Redis list under the rollout's key (``<prefix>inference-router:rollouts:{model}:measures``),
one entry per report with the interval it covers. The leader (:class:`ReplicaMeasures`) takes that
list with its own router's measures at each measurement, in one transaction (read and delete), and
pools them: counts and histograms summed, so a p99 and a Mann-Whitney test rest on every replica's
requests. An entry whose interval began before the analysis did is dropped (a report of the time
before it), as is a follower's first take of a model (what its router counted before then); a
follower's requests of a measurement's last :data:`REPORT_S` count in the next one.

The list expires :data:`TTL_S` after its last report and keeps the newest :data:`MAX_ENTRIES`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from opml_common.errors import OpmlError
from opml_common.lifecycle import Component, cancel_and_wait
from opml_inference_router.routing import Router
from opml_inference_router.routing.shadow import ShadowMeasures
from opml_inference_router.routing.window import Measures, merged

if TYPE_CHECKING:
    from opml_inference_router.control.progressive import Mirrors, RolloutStore

log = logging.getLogger(__name__)

REPORT_S = 0.25
"""How often a follower moves its measures of a running rollout to Redis."""
TTL_S = 3600
MAX_ENTRIES = 100_000


def measures_key(prefix: str, model: str) -> str:
    return f"{prefix}inference-router:rollouts:{model}:measures"


def _dump(since: float, until: float, replica: str, measures: dict[str, Measures],
          shadow: ShadowMeasures | None) -> str:
    versions = {version: {"requests": m.requests, "errors": m.errors, "buckets": len(m.latencies),
                          "latencies": {str(i): c for i, c in enumerate(m.latencies) if c}}
                for version, m in measures.items() if m.requests}
    return json.dumps({"since": since, "until": until, "replica": replica, "versions": versions,
                       "shadow": shadow.__dict__ if shadow is not None else None})


def _load_versions(entry: dict[str, Any]) -> dict[str, Measures]:
    loaded = {}
    for version, data in entry["versions"].items():
        buckets = [0] * data["buckets"]
        for index, count in data["latencies"].items():
            buckets[int(index)] = count
        loaded[version] = merged([Measures(data["requests"], data["errors"], None, tuple(buckets))])
    return loaded


def pooled_shadow(parts: list[ShadowMeasures]) -> ShadowMeasures | None:
    """Several mirrors' comparisons over the same interval as one (None when there is none)."""
    if not parts:
        return None
    rows = sum(p.rows for p in parts)
    return ShadowMeasures(sum(p.mirrored for p in parts), sum(p.shed for p in parts), sum(p.failed for p in parts),
                          sum(p.compared for p in parts), rows, sum(p.disagreed_rows for p in parts),
                          sum(p.mean_difference * p.rows for p in parts) / rows if rows else 0.0)


class LocalMeasures:
    """One router: the analysis reads its own router's measures."""

    def __init__(self, router: Router) -> None:
        self._router = router

    async def begin(self, model: str) -> tuple[dict[str, Measures], ShadowMeasures | None]:
        """Starts the first interval; what was measured before it."""
        return await self.take(model)

    async def take(self, model: str) -> tuple[dict[str, Measures], ShadowMeasures | None]:
        """Version -> its measures since the last take, and the mirror's comparisons (None: no mirror)."""
        return self._router.take_measures(model), self._router.take_shadow_measures(model)


class ReplicaMeasures(LocalMeasures):
    """The leader's: its own router's measures and every follower's reports, pooled."""

    def __init__(self, router: Router, redis: Any, *, prefix: str, clock: Callable[[], float] = time.time) -> None:
        super().__init__(router)
        self._redis, self._prefix, self._clock = redis, prefix, clock
        self._started: dict[str, float] = {}  # model -> when its current interval began

    async def begin(self, model: str) -> tuple[dict[str, Measures], ShadowMeasures | None]:
        self._started[model] = self._clock()
        return await self.take(model)

    async def take(self, model: str) -> tuple[dict[str, Measures], ShadowMeasures | None]:
        own, own_shadow = await super().take(model)
        started = self._started.get(model, 0.0)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.lrange(measures_key(self._prefix, model), 0, -1)
            pipe.delete(measures_key(self._prefix, model))
            entries, _ = await pipe.execute()
        versions: dict[str, list[Measures]] = {v: [m] for v, m in own.items()}
        shadows = [own_shadow] if own_shadow is not None else []
        for raw in entries:
            entry = json.loads(raw)
            if entry["since"] < started:
                continue  # measured (partly) before the analysis began
            for version, measures in _load_versions(entry).items():
                versions.setdefault(version, []).append(measures)
            if entry["shadow"] is not None:
                shadows.append(ShadowMeasures(**entry["shadow"]))
        return {v: merged(parts) if len(parts) > 1 else parts[0] for v, parts in versions.items()}, \
            pooled_shadow(shadows)


class MeasuresReporter(Component):
    """A follower's side (see the module): runs in every replica, reports while ``leading()`` is false."""

    def __init__(self, router: Router, redis: Any, *, prefix: str, store: RolloutStore, mirrors: Mirrors,
                 replica: str, leading: Callable[[], bool], clock: Callable[[], float] = time.time,
                 every_s: float = REPORT_S) -> None:
        super().__init__()
        self._router, self._redis, self._prefix, self._store = router, redis, prefix, store
        self._mirrors, self._replica, self._leading, self._clock, self._every_s = \
            mirrors, replica, leading, clock, every_s
        self._since: dict[str, float] = {}  # model -> when this replica's interval of it began
        self._task: asyncio.Task | None = None

    async def on_start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="rollout-measures-reporter")

    async def on_stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if not self._leading():
            await self._mirrors.stop_all()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._every_s)
            try:
                await self.report()
            except (RedisError, OSError, OpmlError) as error:
                log.warning("reporting the rollouts' measures to the leader failed: %s", error)

    async def report(self) -> None:
        """One report of every running rollout's measures (nothing while this replica leads)."""
        if self._leading():
            self._since.clear()
            self._mirrors.forget()  # the leader's rollouts run the router's mirrors now
            return
        running = {state.model: state for state in await self._store.load() if state.phase == "RUNNING"}
        for model in list(self._since):
            if model not in running:
                del self._since[model]
        await self._mirrors.keep_only(set(running))
        for model, state in running.items():
            if model not in self._router.models():
                continue
            await self._mirrors.follow(state)
            measures, shadow = self._router.take_measures(model), self._router.take_shadow_measures(model)
            now = self._clock()
            since, self._since[model] = self._since.get(model), now
            if since is None:
                continue  # what this router counted before it reported: not the analysis's interval
            key = measures_key(self._prefix, model)
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.rpush(key, _dump(since, now, self._replica, measures, shadow))
                pipe.ltrim(key, -MAX_ENTRIES, -1)
                pipe.expire(key, TTL_S)
                await pipe.execute()
