"""The Trace collector's consumer: Keras epoch logs from opml.traces.v1 -> the trial they belong to.

A trial of an experiment with ``metricsCollectorSpec.collector.kind: Trace`` runs its job traced
(``trace: true``); the trace-collector's tracer in it publishes each Keras epoch's ``logs`` in its
``StepMetricsBatch`` (``epochs``), keyed and sourced ``<job>/<worker>``. :class:`TraceCollector`
is the handler of an ``EventConsumer`` on that topic (``source_prefixes``: the tracers' family):

- An event is a hint. Its data must name the job and worker of its source (else
  :class:`SourceMismatch`, dead-lettered). Its job must be a trial's: the job id names the
  experiment, its uid and the trial number (``{experiment}-{uid}-t{number}``, the controller's
  ids), and that experiment must be running with the Trace kind, that trial running with exactly
  this job, and the worker the trial's primary task (the chief, else worker 0: the task whose log
  the other collectors read). Anything else is ignored: most traced jobs are no trials, and a
  trial's late events after its end change nothing.
- The effect is durable before the offset is committed, and idempotent (redelivery rewrites the
  same fields): the epochs are written to the trial's trace hash in Redis
  (:meth:`ExperimentStore.add_trace`), with the tracer runs that started and stopped; then the
  trial's task is woken (``wake(job_id)``), which reads the hash and reports the new epochs.
- No event-id dedup: the write is idempotent by itself, and dedup would cost a Redis round trip on
  every batch of every traced job, trials or not.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

from opml.traces.v1 import events_pb2 as pb

from opml_automl_controller.experiment import CollectorKind, ExperimentSpec
from opml_automl_controller.state import ExperimentState, ExperimentStore, TrialState
from opml_common.bus import CloudEvent, MalformedEvent
from opml_common.errors import NotFound
from opml_trace_collector_contract.topics import TRACER_SOURCE_PREFIX, tracer_source

log = logging.getLogger(__name__)

GROUP = "automl-controller-traces"
SOURCE_PREFIXES = frozenset({TRACER_SOURCE_PREFIX})
_JOB_ID = re.compile(r"(?P<name>[a-z0-9][-a-z0-9]*)-(?P<uid>[0-9a-f]{6})-t(?P<number>\d+)")
_HANDLED = {pb.StepMetricsBatch.DESCRIPTOR.full_name: pb.StepMetricsBatch,
            pb.TracerStarted.DESCRIPTOR.full_name: pb.TracerStarted,
            pb.TracerStopped.DESCRIPTOR.full_name: pb.TracerStopped}


class SourceMismatch(MalformedEvent):
    """The event's data names another job or worker than its ``ce_source``; never retriable."""


def primary_worker(spec: ExperimentSpec) -> str:
    """The tracer's worker name of a trial's primary task: ``chief-0`` if the template has a chief
    (TFJob Chief/Master, an OpmlJob's chief role), else ``worker-0``."""
    body = spec.trial_template.spec.get("spec")
    body = body if isinstance(body, dict) else {}
    replicas, roles = body.get("tfReplicaSpecs") or {}, body.get("roles") or {}
    has_chief = any(k in ("Chief", "Master") for k in replicas) or "chief" in roles
    return "chief-0" if has_chief else "worker-0"


class TraceCollector:
    """``handle`` is the EventConsumer handler (see the module's docstring).

    Args:
        store: the experiments, trials and their traces.
        spec_of: an experiment's checked spec from its stored Katib YAML.
        wake: called with a trial's job id once new trace data of it is stored.
    """

    def __init__(self, store: ExperimentStore, *, spec_of: Callable, wake: Callable[[str], None]) -> None:
        self._store = store
        self._spec_of = spec_of
        self._wake = wake

    async def handle(self, event: CloudEvent) -> None:
        message_cls = _HANDLED.get(event.type)
        if message_cls is None:  # captures: nothing for the controller
            return
        job, _, worker = (event.subject or "").partition("/")
        named = _JOB_ID.fullmatch(job)
        if named is None:  # no trial's job (the tracer's subject is its job and worker)
            return
        message = event.parse(message_cls)
        if (message.job, message.worker) != (job, worker) or event.source != tracer_source(job, worker):
            raise SourceMismatch(f"event {event.id} ({event.type}) names job {message.job!r} and worker "
                                 f"{message.worker!r}, but its subject is {event.subject!r} and its source "
                                 f"{event.source[:200]!r}; not applied")
        epochs = {(e.fit, e.epoch): dict(e.logs) for e in getattr(message, "epochs", ())}
        started = message.session_id if message_cls is pb.TracerStarted else None
        stopped = message.session_id if message_cls is pb.TracerStopped else None
        if not epochs and not started and not stopped:
            return
        number = int(named["number"])
        why = await self._refusal(named["name"], named["uid"], number, job, worker)
        if why is not None:
            log.debug("trace event %s of %s/%s ignored: %s", event.id, job, worker, why)
            return
        await self._store.add_trace(named["name"], number, epochs=epochs, started=started, stopped=stopped)
        self._wake(job)

    async def _refusal(self, name: str, uid: str, number: int, job: str, worker: str) -> str | None:
        """Why the events of ``job``/``worker`` are not a running Trace trial's, or None when they are."""
        try:
            record = await self._store.experiment(name)
        except NotFound:
            return f"no experiment {name!r}"
        if record.uid != uid:
            return f"experiment {name!r} is another one (uid {record.uid}, not {uid})"
        if record.state is not ExperimentState.RUNNING:
            return f"experiment {name!r} is {record.state.value}"
        spec = self._spec_of(record)
        if spec.collector.kind is not CollectorKind.TRACE:
            return f"experiment {name!r} collects with {spec.collector.kind.value}, not Trace"
        trial = await self._store.trial(name, number)
        if trial is None or trial.job_id != job:
            return f"experiment {name!r} has no trial {number} of job {job!r}"
        if trial.state not in (TrialState.CREATED, TrialState.RUNNING):
            return f"trial {number} has ended ({trial.state.value})"
        if worker != primary_worker(spec):
            return f"worker {worker!r} is not the trial's primary task ({primary_worker(spec)})"
        return None
