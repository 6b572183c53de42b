"""What starts pipeline runs besides the API: committed spans, alerts, schedules.

Events are hints. A ``BundleCommitted`` (opml.bundles.v1, the bundle-store's source only) is acted
on only after the bundle is re-read from the bundle-store and the store says it is committed, in
the context, with the bundle name and tags of a pipeline's ingest step, and tagged ``span``. An
``AlertRaised`` (opml.alerts.v1, the monitoring-scorer's source only) is acted on only when the
monitoring-scorer says the alert (model, version, segment, rule) is still firing (a version monitored per
segment has each segment's alerts apart; "" is the version as a whole). Both then ask the engine for
a run, which coalesces with a run going on. A schedule fires at its cron minutes (UTC) while the
service runs; a minute missed while it was down is not made up.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from opml.bundles.v1 import bundles_pb2
from opml.bundles.v1 import events_pb2 as bundle_events
from opml.jobs.v1 import pipelines_pb2 as pb
from opml.monitoring.v1 import alert_events_pb2, monitoring_pb2

from opml_common.bus import CloudEvent
from opml_common.errors import InvalidArgument, NotFound
from opml_common.lifecycle import Component, cancel_and_wait
from opml_job_orchestrator.pipelines import spans
from opml_job_orchestrator.pipelines.engine import PipelineEngine
from opml_job_orchestrator.pipelines.metrics import PipelineMetrics
from opml_job_orchestrator_contract.schedule import parse_schedule

logger = logging.getLogger(__name__)

SPANS_GROUP = "job-orchestrator-pipeline-spans"
ALERTS_GROUP = "job-orchestrator-pipeline-alerts"
_COMMITTED = bundle_events.BundleCommitted.DESCRIPTOR.full_name
_RAISED = alert_events_pb2.AlertRaised.DESCRIPTOR.full_name


class BundleReader(Protocol):
    async def get(self, context: str, uuid: str) -> bundles_pb2.Bundle:
        """Raises: NotFound, Unavailable."""


class AlertReader(Protocol):
    async def alerts(self, model: str, version: str, segment: str = "") -> list[monitoring_pb2.Alert]:
        """The alerts of a model version (or of its ``segment``), as the monitoring-scorer knows them now."""


def _ingests(pipeline: pb.Pipeline) -> list[pb.IngestConfig]:
    return [step.ingest for step in pipeline.spec.steps if step.kind == pb.STEP_KIND_INGEST]


class SpanTrigger:
    """Handler of an ``EventConsumer`` on BUNDLES (group :data:`SPANS_GROUP`, the bundle-store's source)."""

    def __init__(self, engine: PipelineEngine, bundles: BundleReader, metrics: PipelineMetrics) -> None:
        self._engine, self._bundles, self._metrics = engine, bundles, metrics

    async def handle(self, event: CloudEvent) -> None:
        if event.type != _COMMITTED:
            return
        claimed = event.parse(bundle_events.BundleCommitted).bundle
        watching = [p for p in self._engine.pipelines() if p.spec.triggers.on_span
                    and any(i.context == claimed.context for i in _ingests(p))]
        if not watching or not claimed.uuid:
            return
        try:
            bundle = await self._bundles.get(claimed.context, claimed.uuid)  # the store's word, not the event's
        except NotFound:
            self._metrics.triggers.labels("span", "ignored").inc()
            logger.warning("a committed bundle the store does not know was announced",
                           extra={"context": claimed.context, "uuid": claimed.uuid})
            return
        for pipeline in watching:
            if bundle.committed and any(spans.matches(bundle, i) for i in _ingests(pipeline)):
                about = f"{bundle.context}/{bundle.bundle_name} span {bundle.tags.get(spans.SPAN_TAG)} ({bundle.uuid})"
                await self._trigger(pipeline.spec.name, about)

    async def _trigger(self, name: str, about: str) -> None:
        try:
            await self._engine.trigger(name, "span", about)
        except NotFound:  # removed meanwhile
            self._metrics.triggers.labels("span", "ignored").inc()


class AlertTrigger:
    """Handler of an ``EventConsumer`` on ALERTS (group :data:`ALERTS_GROUP`, the monitoring-scorer's source)."""

    def __init__(self, engine: PipelineEngine, alerts: AlertReader, metrics: PipelineMetrics) -> None:
        self._engine, self._alerts, self._metrics = engine, alerts, metrics

    async def handle(self, event: CloudEvent) -> None:
        if event.type != _RAISED:
            return
        raised = event.parse(alert_events_pb2.AlertRaised)
        watching = [p for p in self._engine.pipelines() if p.spec.triggers.on_alert
                    and any(s.kind == pb.STEP_KIND_PUSH and s.push.model == raised.model for s in p.spec.steps)]
        if not watching:
            return
        try:
            known = await self._alerts.alerts(raised.model, raised.version, raised.segment)
        except (NotFound, InvalidArgument):  # the scorer does not monitor that version (or per segment): nothing fires
            known = []
        firing = [a for a in known if a.rule == raised.rule and a.segment == raised.segment and a.firing]
        if not firing:
            self._metrics.triggers.labels("alert", "ignored").inc()
            logger.info("an alert was announced but is not firing now; no run",
                        extra={"model": raised.model, "version": raised.version, "segment": raised.segment,
                               "rule": raised.rule})
            return
        about = f"{raised.model} version {raised.version}" + (f" segment {raised.segment}" if raised.segment else "")
        for pipeline in watching:
            try:
                await self._engine.trigger(pipeline.spec.name, "alert", f"{about} rule {raised.rule}")
            except NotFound:
                self._metrics.triggers.labels("alert", "ignored").inc()


class ScheduleTrigger(Component):
    """Fires each pipeline's cron schedule. :meth:`changed` (the engine's hook) re-reads the schedules.
    ``now`` gives the current time (aware); ``sleep`` waits (both for tests)."""

    def __init__(self, engine: PipelineEngine, *, now: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        super().__init__()
        self._engine, self._now, self._sleep = engine, now, sleep
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def changed(self) -> None:
        self._wake.set()

    async def on_start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="pipeline schedules")

    async def on_stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            now = self._now()
            due: dict[str, dt.datetime] = {}
            for pipeline in self._engine.pipelines():
                if pipeline.spec.triggers.schedule:
                    try:
                        due[pipeline.spec.name] = parse_schedule(pipeline.spec.triggers.schedule).next_after(now)
                    except InvalidArgument:
                        continue
            if not due:
                await self._wake.wait()
                continue
            at = min(due.values())
            sleeper = asyncio.create_task(self._sleep(max(0.0, (at - now).total_seconds())))
            waker = asyncio.create_task(self._wake.wait())
            done, _ = await asyncio.wait({sleeper, waker}, return_when=asyncio.FIRST_COMPLETED)
            sleeper.cancel()
            waker.cancel()
            if waker in done:
                continue
            for name in [n for n, when in due.items() if when == at]:
                try:
                    await self._engine.trigger(name, "schedule", at.strftime("%Y-%m-%dT%H:%MZ"))
                except NotFound:
                    pass
                except Exception:  # noqa: BLE001 - Redis away: this minute is missed, the next one is not
                    logger.exception("the schedule of pipeline %s could not start a run", name)


class ScorerAlerts:
    """:class:`AlertReader` over the monitoring-scorer's API (its contract's asyncio client, on the
    service's event loop). Made on that loop; :meth:`aclose` at shutdown, once the consumers have stopped."""

    def __init__(self, target: str, *, token: str | None = None) -> None:
        from opml_monitoring_scorer_contract.aioclient import AsyncMonitoringClient

        self._client = AsyncMonitoringClient(target, token=token)

    async def aclose(self) -> None:
        await self._client.close()

    async def alerts(self, model: str, version: str, segment: str = "") -> list[monitoring_pb2.Alert]:
        return await self._client.alerts(model, version, segment=segment)
