"""Python client of the job-orchestrator API, used by the CLI and by other services (automl-controller).

Failed calls raise the platform's domain errors (``NotFound``, ``InvalidArgument``...), never a
bare ``grpc.RpcError``.
"""

from __future__ import annotations

from collections.abc import Iterator

from opml.jobs.v1 import jobs_pb2 as pb
from opml.jobs.v1 import jobs_pb2_grpc

from opml_common.grpc.client import open_channel, raising_domain_errors, stream_raising_domain_errors
from opml_job_orchestrator.convert import job_name


class JobClient:
    def __init__(self, target: str, *, token: str | None = None) -> None:
        self._channel = open_channel(target, token=token)
        self._stub = jobs_pb2_grpc.JobServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> JobClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @raising_domain_errors
    def submit(self, spec: pb.JobSpec) -> pb.Job:
        return self._stub.SubmitJob(pb.SubmitJobRequest(spec=spec))

    @raising_domain_errors
    def get(self, job_id: str) -> pb.Job:
        return self._stub.GetJob(pb.GetJobRequest(name=job_name(job_id)))

    @raising_domain_errors
    def list(self, *, state: int = pb.JOB_STATE_UNSPECIFIED) -> list[pb.Job]:
        jobs, token = [], ""
        while True:
            reply = self._stub.ListJobs(pb.ListJobsRequest(state=state, page_token=token))
            jobs.extend(reply.jobs)
            if not (token := reply.next_page_token):
                return jobs

    @raising_domain_errors
    def cancel(self, job_id: str) -> pb.Job:
        return self._stub.CancelJob(pb.CancelJobRequest(name=job_name(job_id)))

    @raising_domain_errors
    def preempt(self, job_id: str) -> pb.Job:
        """Needs the admin role."""
        return self._stub.PreemptJob(pb.PreemptJobRequest(name=job_name(job_id)))

    def logs(self, job_id: str, *, role: str = "", index: int = 0, attempt: int | None = None,
             follow: bool = False) -> Iterator[pb.LogChunk]:
        """What one task wrote; with ``follow``, streamed until the job ends."""
        request = pb.ReadJobLogsRequest(name=job_name(job_id), role=role, index=index, follow=follow)
        if attempt is not None:
            request.attempt = attempt
        return stream_raising_domain_errors(self._stub.ReadJobLogs(request))

    def watch(self, job_id: str = "") -> Iterator[pb.JobChange]:
        """The current status (kind unspecified) of one job or of every job, then each change as it
        happens: of one job until it ends, of every job until the caller stops reading."""
        return stream_raising_domain_errors(
            self._stub.WatchJobs(pb.WatchJobsRequest(name=job_name(job_id) if job_id else "")))
