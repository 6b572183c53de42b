"""The JobService gRPC servicer: parses requests, calls the orchestrator, converts the answers.

Who may act on a job beyond the role table: its logs and its cancel belong to the principal who
submitted it (``current_principal().name`` at submit, kept with the job) and to admins; anyone
else gets PERMISSION_DENIED. Preempting needs admin (the role table). The same two see a job's env
values in every reply that holds its spec (GetJob, ListJobs, and the Job that SubmitJob, CancelJob
and PreemptJob answer with): everyone else sees each env name with the value ``(hidden)``
(:func:`may_act_on`, applied in :meth:`JobServicer._job`, per job and per caller). WatchJobs'
changes carry the status and a message, never the spec. A job's ``secret_env`` is shown to no one:
no reply holds it, its submitter's and admins' included.

It holds no scheduling logic: that is the :class:`~opml_job_orchestrator.orchestrator.Orchestrator`'s,
which imports no grpc. It builds and publishes no events: each change's event comes from the core
(the orchestrator's :class:`~opml_job_orchestrator.recorder.JobRecorder`). Domain errors become
status codes in the shared ObservabilityInterceptor.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable

from opml.jobs.v1 import jobs_pb2 as pb
from opml.jobs.v1 import jobs_pb2_grpc

from opml_common.errors import InvalidArgument, NotFound, PermissionDenied, Unavailable
from opml_common.grpc.interceptors import Principal, current_principal
from opml_common.pagination import paginate
from opml_job_orchestrator.convert import STATES_FROM_PROTO, job_to_proto, status_to_proto
from opml_job_orchestrator.executor.base import Executor
from opml_job_orchestrator.orchestrator import TERMINAL_STATES, JobStatus, Orchestrator
from opml_job_orchestrator.spec import definition_from_proto
from opml_job_orchestrator.watch import WatchHub

# The role each RPC needs (every RPC is listed: the server checks this against the service at start-up).
METHOD_ROLES = {"GetJob": "reader", "ListJobs": "reader", "ReadJobLogs": "reader", "WatchJobs": "reader",
                "SubmitJob": "writer", "CancelJob": "writer", "PreemptJob": "admin"}

_JOB_NAME = re.compile(r"^jobs/([^/]+)$")
_LOG_CHUNK_BYTES = 256 * 1024


def parse_job_name(field: str, name: str) -> str:
    match = _JOB_NAME.match(name)
    if not match:
        raise InvalidArgument(field, f"must look like jobs/{{job}}, but got {name!r}")
    return match.group(1)


def may_act_on(principal: Principal, submitter: str | None) -> bool:
    """Whether ``principal`` may read the logs, cancel and see the env values of a job that
    ``submitter`` submitted (None: saved before submitters were recorded, so admins only)."""
    return principal.has("admin") or (submitter is not None and principal.name == submitter)


class JobServicer(jobs_pb2_grpc.JobServiceServicer):
    """``durable`` returns once every change so far is saved (``JobStore.flushed``): requests that
    change a job await it, up to ``durable_timeout_s``, before they answer."""

    def __init__(self, orchestrator: Orchestrator, executor: Executor, watch: WatchHub, *,
                 durable: Callable[[], Awaitable[None]], durable_timeout_s: float = 10.0,
                 log_poll_s: float = 0.2) -> None:
        self._orchestrator = orchestrator
        self._executor = executor
        self._watch = watch
        self._durable = durable
        self._durable_timeout_s = durable_timeout_s
        self._log_poll_s = log_poll_s

    async def SubmitJob(self, request: pb.SubmitJobRequest, context) -> pb.Job:
        if not request.HasField("spec"):
            raise InvalidArgument("spec", "is required")
        definition = definition_from_proto(request.spec)
        job_id = self._orchestrator.submit(definition.spec, definition.program, max_retries=definition.max_retries,
                                           submitter=current_principal().name, labels=definition.labels)
        status = self._orchestrator.get(job_id)  # the answer is the job as queued
        await self._saved(job_id, "submitted")
        return self._job(job_id, status)

    async def GetJob(self, request: pb.GetJobRequest, context) -> pb.Job:
        return self._job(parse_job_name("name", request.name))

    async def ListJobs(self, request: pb.ListJobsRequest, context) -> pb.ListJobsResponse:
        if request.state not in STATES_FROM_PROTO and request.state != pb.JOB_STATE_UNSPECIFIED:
            raise InvalidArgument("state", f"must be a JobState, but got {request.state}")
        statuses = self._orchestrator.list()
        if request.state != pb.JOB_STATE_UNSPECIFIED:
            statuses = [s for s in statuses if s.state is STATES_FROM_PROTO[request.state]]
        if request.labels:
            wanted = dict(request.labels).items()
            statuses = [s for s in statuses if wanted <= self._orchestrator.definition(s.job_id).labels.items()]
        query = f"{request.state}:{sorted(request.labels.items())}"
        page, token = paginate(statuses, request.page_size, request.page_token, query=query)
        return pb.ListJobsResponse(jobs=[self._job(s.job_id, s) for s in page], next_page_token=token)

    async def CancelJob(self, request: pb.CancelJobRequest, context) -> pb.Job:
        job_id = parse_job_name("name", request.name)
        self._check_owner(job_id, "CancelJob", "cancel")
        status = await self._orchestrator.cancel(job_id)
        await self._saved(status.job_id, "cancelled")
        return self._job(status.job_id, status)

    async def PreemptJob(self, request: pb.PreemptJobRequest, context) -> pb.Job:
        status = await self._orchestrator.preempt(parse_job_name("name", request.name))
        await self._saved(status.job_id, "preempted")
        return self._job(status.job_id, status)

    async def ReadJobLogs(self, request: pb.ReadJobLogsRequest, context) -> AsyncIterator[pb.LogChunk]:
        job_id = parse_job_name("name", request.name)
        self._check_owner(job_id, "ReadJobLogs", "read the logs of")
        roles = self._orchestrator.definition(job_id).spec.roles
        role = request.role or ("chief" if "chief" in roles else next(iter(roles)))
        if role not in roles:
            raise InvalidArgument("role", f"job {job_id!r} has roles {list(roles)}, not {role!r}")
        if not 0 <= request.index < roles[role].replicas:
            raise InvalidArgument("index", f"must be in [0, {roles[role].replicas}) for role {role!r}, "
                                           f"but got {request.index}")
        pinned = request.attempt if request.HasField("attempt") else None
        if pinned is not None and pinned < 0:
            raise InvalidArgument("attempt", f"must be >= 0, but got {pinned}")
        attempt, sent = pinned, 0
        while True:
            status = self._orchestrator.get(job_id)
            if attempt is None or (pinned is None and status.attempt > attempt):
                if attempt is not None and attempt >= 0:  # a later run started: the rest of this one first
                    async for chunk in self._log_tail(job_id, role, request.index, attempt, sent, missing_ok=True):
                        yield chunk
                attempt, sent = status.attempt, 0
            ended = status.state in TERMINAL_STATES or (pinned is not None and status.attempt > pinned)
            if attempt >= 0:
                async for chunk in self._log_tail(job_id, role, request.index, attempt, sent,
                                                  missing_ok=request.follow):
                    sent += len(chunk.data)
                    yield chunk
            if not request.follow or ended:
                return
            await asyncio.sleep(self._log_poll_s)

    async def WatchJobs(self, request: pb.WatchJobsRequest, context) -> AsyncIterator[pb.JobChange]:
        job_id = parse_job_name("name", request.name) if request.name else None
        with self._watch.subscribe(job_id) as watcher:  # where things stand now, then each change
            if job_id is not None:
                status = self._orchestrator.get(job_id)
                yield pb.JobChange(status=status_to_proto(status))
                if status.state in TERMINAL_STATES:
                    return
            else:
                for status in self._orchestrator.list():
                    yield pb.JobChange(status=status_to_proto(status))
            while True:
                change = await watcher.next()
                yield change
                if job_id is not None and STATES_FROM_PROTO[change.status.state] in TERMINAL_STATES:
                    return

    async def _log_tail(self, job_id: str, role: str, index: int, attempt: int, offset: int, *,
                        missing_ok: bool) -> AsyncIterator[pb.LogChunk]:
        """What the task of run ``attempt`` wrote after its first ``offset`` bytes, exactly as it
        wrote it (the executor reads only that part); with ``missing_ok``, nothing when the run has
        not started the task (yet)."""
        try:
            text = await self._executor.logs(job_id, role, index, attempt=attempt, offset=offset)
        except NotFound:
            if missing_ok:
                return
            raise
        data = text.encode("utf-8", "surrogateescape")
        for start in range(0, len(data), _LOG_CHUNK_BYTES):
            yield pb.LogChunk(attempt=attempt, data=data[start:start + _LOG_CHUNK_BYTES])

    async def _saved(self, job_id: str, done: str) -> None:
        try:
            await asyncio.wait_for(self._durable(), self._durable_timeout_s)
        except TimeoutError:
            raise Unavailable(f"job {job_id!r} was {done}, but its state could not be saved to Redis within "
                              f"{self._durable_timeout_s:g} s; it is saved once Redis answers (check with get)"
                              ) from None

    def _check_owner(self, job_id: str, method: str, what: str) -> None:
        """Let the job's submitter and admins through; refuse anyone else.

        Raises:
            NotFound: no such job.
            PermissionDenied: the caller is neither.
        """
        if may_act_on(current_principal(), self._orchestrator.definition(job_id).submitter):
            return
        raise PermissionDenied(f"{method} on job {job_id!r} needs the admin role, or to be its submitter: only "
                               f"they may {what} it; the caller is another principal")

    def _job(self, job_id: str, status: JobStatus | None = None) -> pb.Job:
        """The job as the caller may see it: env values only for its submitter and admins."""
        definition = self._orchestrator.definition(job_id)
        return job_to_proto(definition, status or self._orchestrator.get(job_id),
                            env_values=may_act_on(current_principal(), definition.submitter))
