"""How the controller runs a trial's job: the job-orchestrator, through its Python client.

:class:`TrialJobs` is the port the controller is written against (blocking calls; the controller
runs them on threads); :class:`OrchestratorJobs` is the real one, over ``JobClient``. Submission
is idempotent by job id: the id is the trial's, and a job that exists already (a submission whose
answer was lost, a controller restarted after submitting) is taken as it is, never submitted twice.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

from opml.jobs.v1 import jobs_pb2

from opml_common.errors import AlreadyExists, FailedPrecondition, NotFound
from opml_job_orchestrator_contract.client import JobClient

ENDED = {jobs_pb2.JOB_STATE_SUCCEEDED: "succeeded", jobs_pb2.JOB_STATE_FAILED: "failed",
         jobs_pb2.JOB_STATE_CANCELLED: "cancelled"}


@dataclass(frozen=True, slots=True)
class JobView:
    job_id: str
    state: str
    """pending, running, preempted, retrying, succeeded, failed or cancelled."""
    cause: str = ""

    @property
    def ended(self) -> bool:
        return self.state in ("succeeded", "failed", "cancelled")


class TrialJobs(ABC):
    """The orchestrator as a trial sees it. Every method blocks; each may raise the platform's
    domain errors (``Unavailable`` is retriable: the controller retries it)."""

    @abstractmethod
    def ensure(self, spec: jobs_pb2.JobSpec) -> JobView:
        """The job ``spec.name``: submitted now, or as it is if it exists already.

        Raises:
            InvalidArgument: the orchestrator refused the spec (the trial fails with its message).
        """

    @abstractmethod
    def get(self, job_id: str) -> JobView:
        """Raises: NotFound: no such job."""

    @abstractmethod
    def cancel(self, job_id: str) -> JobView:
        """Cancel the job if it has not ended (its resources are freed at once). A job that was
        never submitted is nothing to cancel: it comes back cancelled, with that cause."""

    @abstractmethod
    def follow(self, job_id: str) -> Iterator[str]:
        """What the job's primary task writes, as it writes it, until the job ends."""


def _view(job: jobs_pb2.Job) -> JobView:
    state = jobs_pb2.JobState.Name(job.status.state).removeprefix("JOB_STATE_").lower()
    return JobView(job_id=job.status.job_id, state=state, cause=job.status.cause)


class OrchestratorJobs(TrialJobs):
    def __init__(self, target: str, *, token: str | None = None) -> None:
        self._client = JobClient(target, token=token)

    def close(self) -> None:
        self._client.close()

    async def aclose(self) -> None:
        self.close()

    def ensure(self, spec: jobs_pb2.JobSpec) -> JobView:
        try:
            return _view(self._client.get(spec.name))  # re-read before (re)submitting
        except NotFound:
            pass
        try:
            return _view(self._client.submit(spec))
        except AlreadyExists:
            return _view(self._client.get(spec.name))

    def get(self, job_id: str) -> JobView:
        return _view(self._client.get(job_id))

    def cancel(self, job_id: str) -> JobView:
        try:
            job = self._client.get(job_id)
            if job.status.state in ENDED:
                return _view(job)
            try:
                return _view(self._client.cancel(job_id))
            except FailedPrecondition:  # it ended between the two calls
                return _view(self._client.get(job_id))
        except NotFound:  # a trial killed or deleted before its job was submitted
            return JobView(job_id=job_id, state="cancelled", cause="never submitted")

    def follow(self, job_id: str) -> Iterator[str]:
        for chunk in self._client.logs(job_id, follow=True):
            yield chunk.data.decode("utf-8", "replace")
