"""The JobService gRPC servicer: parses requests, calls the orchestrator, converts the answers.

Who may act on a job beyond the role table: its logs and its cancel belong to the principal who
submitted it (``current_principal().name`` at submit, kept with the job) and to admins; anyone
else gets PERMISSION_DENIED. Preempting needs admin (the role table). The same two see a job's env
values in every reply that holds its spec (GetJob, ListJobs, and the Job that SubmitJob, CancelJob
and PreemptJob answer with): everyone else sees each env name with the value ``(hidden)``
(:func:`may_act_on`, applied in :meth:`JobServicer._job`, per job and per caller). WatchJobs'
changes carry the status and a message, never the spec. A job's ``secret_env`` is shown to no one:
no reply holds it, its submitter's and admins' included.

Any replica serves it: :class:`~opml_job_orchestrator.access.JobAccess` reads the leader's memory or
the shared store and hands a follower's changes to the leader. A follower's WatchJobs reads the
store every ``log_poll_s`` (the leader's watchers see each change as it is made). Logs are read from
this replica's executor: with the local executor, the job's logs are on the replica that ran it.

It holds no scheduling logic: that is the :class:`~opml_job_orchestrator.orchestrator.Orchestrator`'s,
which imports no grpc. It builds and publishes no events: each change's event comes from the core
(the orchestrator's :class:`~opml_job_orchestrator.recorder.JobRecorder`). Domain errors become
status codes in the shared ObservabilityInterceptor.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable

from opml.jobs.v1 import jobs_pb2 as pb
from opml.jobs.v1 import jobs_pb2_grpc

from opml_common.errors import InvalidArgument, NotFound, PermissionDenied
from opml_common.grpc.interceptors import Principal, current_principal
from opml_common.pagination import paginate
from opml_job_orchestrator.access import JobAccess
from opml_job_orchestrator.convert import STATES_FROM_PROTO, job_to_proto, status_to_proto
from opml_job_orchestrator.executor.base import Executor
from opml_job_orchestrator.orchestrator import TERMINAL_STATES, SavedJob
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
    """``jobs`` reads and changes jobs on this replica (the leader's or the store's, see the module);
    ``leading`` says whether this replica leads now (its watchers then see each change)."""

    def __init__(self, jobs: JobAccess, executor: Executor, watch: WatchHub, *, leading: Callable[[], bool],
                 log_poll_s: float = 0.2) -> None:
        self._jobs = jobs
        self._executor = executor
        self._watch = watch
        self._leading = leading
        self._log_poll_s = log_poll_s

    async def SubmitJob(self, request: pb.SubmitJobRequest, context) -> pb.Job:
        if not request.HasField("spec"):
            raise InvalidArgument("spec", "is required")
        return self._job(await self._jobs.submit(request.spec, current_principal().name))

    async def GetJob(self, request: pb.GetJobRequest, context) -> pb.Job:
        return self._job(await self._jobs.get(parse_job_name("name", request.name)))

    async def ListJobs(self, request: pb.ListJobsRequest, context) -> pb.ListJobsResponse:
        if request.state not in STATES_FROM_PROTO and request.state != pb.JOB_STATE_UNSPECIFIED:
            raise InvalidArgument("state", f"must be a JobState, but got {request.state}")
        jobs = await self._jobs.list()
        if request.state != pb.JOB_STATE_UNSPECIFIED:
            jobs = [j for j in jobs if j.status.state is STATES_FROM_PROTO[request.state]]
        if request.labels:
            wanted = dict(request.labels).items()
            jobs = [j for j in jobs if wanted <= j.definition.labels.items()]
        query = f"{request.state}:{sorted(request.labels.items())}"
        page, token = paginate(jobs, request.page_size, request.page_token, query=query)
        return pb.ListJobsResponse(jobs=[self._job(j) for j in page], next_page_token=token)

    async def CancelJob(self, request: pb.CancelJobRequest, context) -> pb.Job:
        job_id = parse_job_name("name", request.name)
        await self._check_owner(job_id, "CancelJob", "cancel")
        return self._job(await self._jobs.cancel(job_id))

    async def PreemptJob(self, request: pb.PreemptJobRequest, context) -> pb.Job:
        return self._job(await self._jobs.preempt(parse_job_name("name", request.name)))

    async def ReadJobLogs(self, request: pb.ReadJobLogsRequest, context) -> AsyncIterator[pb.LogChunk]:
        job_id = parse_job_name("name", request.name)
        roles = (await self._check_owner(job_id, "ReadJobLogs", "read the logs of")).definition.spec.roles
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
            status = (await self._jobs.get(job_id)).status
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
        if not self._leading():
            async for change in self._watch_store(job_id):
                yield change
            return
        with self._watch.subscribe(job_id) as watcher:  # where things stand now, then each change
            if job_id is not None:
                status = (await self._jobs.get(job_id)).status
                yield pb.JobChange(status=status_to_proto(status))
                if status.state in TERMINAL_STATES:
                    return
            else:
                for job in await self._jobs.list():
                    yield pb.JobChange(status=status_to_proto(job.status))
            while True:
                change = await watcher.next()
                yield change
                if job_id is not None and STATES_FROM_PROTO[change.status.state] in TERMINAL_STATES:
                    return

    async def _watch_store(self, job_id: str | None) -> AsyncIterator[pb.JobChange]:
        """A follower's watch: where things stand, then each status the store shows changed (read every
        ``log_poll_s``; a change the leader made and overwrote between two reads is seen as the later one)."""
        seen: dict[str, pb.JobStatus] = {}
        while True:
            jobs = [await self._jobs.get(job_id)] if job_id is not None else await self._jobs.list()
            for job in jobs:
                status = status_to_proto(job.status)
                if seen.get(job.status.job_id) != status:
                    seen[job.status.job_id] = status
                    yield pb.JobChange(status=status)
                if job_id is not None and job.status.state in TERMINAL_STATES:
                    return
            await asyncio.sleep(self._log_poll_s)

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

    async def _check_owner(self, job_id: str, method: str, what: str) -> SavedJob:
        """Let the job's submitter and admins through; refuse anyone else.

        Raises:
            NotFound: no such job.
            PermissionDenied: the caller is neither.
        """
        job = await self._jobs.get(job_id)
        if may_act_on(current_principal(), job.definition.submitter):
            return job
        raise PermissionDenied(f"{method} on job {job_id!r} needs the admin role, or to be its submitter: only "
                               f"they may {what} it; the caller is another principal")

    def _job(self, job: SavedJob) -> pb.Job:
        """The job as the caller may see it: env values only for its submitter and admins."""
        return job_to_proto(job.definition, job.status,
                            env_values=may_act_on(current_principal(), job.definition.submitter))
