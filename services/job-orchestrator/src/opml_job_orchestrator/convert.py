"""Conversions between the orchestrator's dataclasses and the opml.jobs.v1 messages (no logic here).

Specs are parsed and checked by the contract (:mod:`opml_job_orchestrator_contract.jobspec`) and turned into
what the orchestrator runs by :mod:`opml_job_orchestrator.spec`.
"""

from __future__ import annotations

import math

from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp
from opml.jobs.v1 import events_pb2
from opml.jobs.v1 import jobs_pb2 as pb

from opml_job_orchestrator.orchestrator import EventKind, JobDefinition, JobState, JobStatus, LifecycleEvent, SavedJob
from opml_job_orchestrator.spec import definition_from_proto, definition_to_proto
from opml_job_orchestrator_contract.names import job_name

STATES = {state: pb.JobState.Value(f"JOB_STATE_{state.name}") for state in JobState}
STATES_FROM_PROTO = {value: state for state, value in STATES.items()}
KINDS = {kind: pb.ChangeKind.Value(f"CHANGE_KIND_{kind.name}") for kind in EventKind}
EVENT_MESSAGES: dict[EventKind, type[Message]] = {
    kind: getattr(events_pb2, f"Job{kind.name.capitalize()}") for kind in EventKind}
"""The CloudEvent data message of each lifecycle event (``opml.jobs.v1.JobSucceeded``...)."""


def _timestamp(seconds: float | None) -> Timestamp | None:
    if seconds is None:
        return None
    whole = math.floor(seconds)
    return Timestamp(seconds=whole, nanos=min(999_999_999, round((seconds - whole) * 1e9)))


def _seconds(stamp: Timestamp, present: bool) -> float | None:
    return stamp.seconds + stamp.nanos / 1e9 if present else None


def status_to_proto(status: JobStatus) -> pb.JobStatus:
    message = pb.JobStatus(
        job_id=status.job_id, state=STATES[status.state], attempt=status.attempt, retries=status.retries,
        preemptions=status.preemptions, cause=status.cause or "", submit_time=_timestamp(status.submitted_at),
        start_time=_timestamp(status.started_at), update_time=_timestamp(status.updated_at),
        end_time=_timestamp(status.ended_at))
    if status.checkpoint_step is not None:
        message.checkpoint_step = status.checkpoint_step
    return message


def status_from_proto(message: pb.JobStatus) -> JobStatus:
    return JobStatus(
        job_id=message.job_id, state=STATES_FROM_PROTO[message.state], attempt=message.attempt,
        retries=message.retries, preemptions=message.preemptions, cause=message.cause or None,
        submitted_at=_seconds(message.submit_time, True), started_at=_seconds(message.start_time,
                                                                             message.HasField("start_time")),
        updated_at=_seconds(message.update_time, True),
        ended_at=_seconds(message.end_time, message.HasField("end_time")),
        checkpoint_step=message.checkpoint_step if message.HasField("checkpoint_step") else None)


ENV_HIDDEN = "(hidden)"
"""What an API reply shows in place of each env value to a caller who is neither the job's submitter
nor an admin (the names stay; see :func:`job_to_proto`)."""


def hide_env_values(spec: pb.JobSpec, marker: str = ENV_HIDDEN) -> None:
    """Replace the value of each of ``spec``'s env variables with ``marker``, in place (names kept)."""
    for name in list(spec.env):
        spec.env[name] = marker


def job_to_proto(definition: JobDefinition, status: JobStatus, *, env_values: bool = True,
                 secret_env: bool = False) -> pb.Job:
    """The job as the API and the store show it; without ``env_values``, each env value is
    :data:`ENV_HIDDEN` (the servicer decides who sees them; the store and events get every value,
    and events drop them themselves). The secret env is in it only with ``secret_env``: the store's
    copy, which nothing shows (no reply, no event, no watcher)."""
    job = pb.Job(name=job_name(status.job_id), spec=definition_to_proto(definition, secret_env=secret_env),
                 status=status_to_proto(status))
    if not env_values:
        hide_env_values(job.spec)
    return job


def saved_job_from_proto(message: pb.Job, *, submitter: str | None = None) -> SavedJob:
    """A saved job as the store kept it (its env is not checked again: it was at its submit)."""
    return SavedJob(definition_from_proto(message.spec, submitter=submitter, check_job_env=False),
                    status_from_proto(message.status))


def change_to_proto(event: LifecycleEvent, job: pb.Job) -> pb.JobChange:
    """The watch stream's message of one lifecycle event of ``job`` (as :func:`job_to_proto` made it)."""
    return pb.JobChange(kind=KINDS[event.kind], status=job.status, message=event.message)


def event_to_proto(event: LifecycleEvent, job: pb.Job) -> Message:
    """The CloudEvent data of one lifecycle event of ``job`` (as :func:`job_to_proto` made it, so a
    transition converts its status and spec once); ``JobSubmitted`` also carries the spec, with the
    names of its env but not their values (anyone who reads the topic reads the event; a value may
    be a credential of the submitter's), and nothing of its secret env."""
    message = EVENT_MESSAGES[event.kind](status=job.status, message=event.message)
    if event.kind is EventKind.SUBMITTED:
        message.spec.CopyFrom(job.spec)
        hide_env_values(message.spec, "")
        message.spec.ClearField("secret_env")
    return message
