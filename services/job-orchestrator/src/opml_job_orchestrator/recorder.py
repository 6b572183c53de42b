"""What every job transition does beyond the orchestrator's memory: one :class:`JobRecorder`.

The :class:`~opml_job_orchestrator.orchestrator.Orchestrator` calls its listeners, in its loop, on
each :class:`~opml_job_orchestrator.orchestrator.LifecycleEvent`; the service's one listener is a
``JobRecorder``, which, in this order: queues the job's snapshot for Redis (:class:`JobStore`; a
request that changed the job awaits ``JobStore.flushed`` before it answers), emits the job's domain
event (``opml.jobs.v1.Job<Kind>``, subject the job id) through the service's :class:`EventEmitter`,
which records it durably before the transition returns, shows the change to watch streams
(:class:`WatchHub`) and counts it (:class:`JobMetrics`). None of these blocks the loop.

An event that cannot be recorded (the outbox's disk is full or gone) is logged loudly and the job
goes on: the change has happened, and watchers and metrics still see it.
"""

from __future__ import annotations

import logging
from collections import Counter

from opml_common.events import EventEmitter
from opml_job_orchestrator.convert import change_to_proto, event_to_proto, job_to_proto, saved_job_from_proto
from opml_job_orchestrator.metrics import JobMetrics
from opml_job_orchestrator.orchestrator import EventKind, LifecycleEvent, SavedJob
from opml_job_orchestrator.state import JobStore
from opml_job_orchestrator.watch import WatchHub

logger = logging.getLogger(__name__)


class JobRecorder:
    """The orchestrator's lifecycle listener: each transition saved, announced once, watched, counted.

    Keyword-only parts: ``store`` (the job snapshots in Redis), ``emitter`` (the one way the core
    publishes domain events), ``watch`` (the watch streams) and ``metrics``. Called from the
    orchestrator's event loop only.
    """

    def __init__(self, *, store: JobStore, emitter: EventEmitter, watch: WatchHub, metrics: JobMetrics) -> None:
        self._store = store
        self._emitter = emitter
        self._watch = watch
        self._metrics = metrics

    async def load(self) -> list[SavedJob]:
        """The jobs the store kept, in submission order, for ``Orchestrator.restore``; each is
        counted in the metrics in the state it was saved in.

        Raises:
            redis.exceptions.RedisError: Redis cannot be reached.
            DataLoss: a saved job does not parse.
            InvalidArgument: a saved spec is invalid.
        """
        jobs = await self._store.load()
        submitters = await self._store.load_submitters()
        saved = [saved_job_from_proto(job, submitter=submitters.get(job.status.job_id)) for job in jobs]
        for item in saved:
            self._metrics.seed(item.status, item.definition.spec.job_class)
        if saved:
            states = Counter(item.status.state.value for item in saved)
            logger.info("loaded %d jobs from Redis (as saved: %s)", len(saved), dict(states))
        return saved

    def __call__(self, event: LifecycleEvent) -> None:
        """Record one transition (see the module's docstring for what, in which order); never blocks.

        Raises:
            Whatever a part raises other than the emitter's ``OSError`` (a bug; the orchestrator logs it).
        """
        definition = event.job.definition
        job = job_to_proto(definition, event.job.status)  # converted once, for event and watchers
        stored = job_to_proto(definition, event.job.status, secret_env=True) if definition.program.secret_env else job
        self._store.save(stored, submitter=definition.submitter if event.kind is EventKind.SUBMITTED else None)
        try:
            self._emitter.emit(event_to_proto(event, job), subject=event.job_id)
        except OSError:  # the disk is full or gone: say so loudly, keep the orchestrator going
            logger.exception("could not record the %s event of job %s in the outbox", event.kind.value,
                             event.job_id)
        self._watch.notify(change_to_proto(event, job))
        self._metrics.observe(event, definition.spec.job_class)
