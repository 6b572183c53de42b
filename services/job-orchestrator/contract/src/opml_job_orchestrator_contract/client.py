"""Python client of the job-orchestrator API, used by the CLI and by other services (automl-controller).

Failed calls raise the platform's domain errors (``NotFound``, ``InvalidArgument``...), never a
bare ``grpc.RpcError``, server streams (logs, watch) included.
"""

from __future__ import annotations

from collections.abc import Iterator

from opml.jobs.v1 import jobs_pb2 as pb
from opml.jobs.v1 import jobs_pb2_grpc

from opml_common.grpc.client import ServiceClient, pages
from opml_job_orchestrator_contract.names import job_name


class JobClient(ServiceClient):
    stub_class = jobs_pb2_grpc.JobServiceStub

    def submit(self, spec: pb.JobSpec) -> pb.Job:
        return self.stub.SubmitJob(pb.SubmitJobRequest(spec=spec))

    def get(self, job_id: str) -> pb.Job:
        return self.stub.GetJob(pb.GetJobRequest(name=job_name(job_id)))

    def list(self, *, state: int = pb.JOB_STATE_UNSPECIFIED, labels: dict[str, str] | None = None) -> list[pb.Job]:
        """Every job (in ``state``, unless unspecified; carrying all of ``labels``), in submission order."""
        return list(pages(lambda token: self.stub.ListJobs(pb.ListJobsRequest(state=state, page_token=token,
                                                                              labels=labels or {})),
                          lambda reply: reply.jobs))

    def cancel(self, job_id: str) -> pb.Job:
        return self.stub.CancelJob(pb.CancelJobRequest(name=job_name(job_id)))

    def preempt(self, job_id: str) -> pb.Job:
        """Needs the admin role."""
        return self.stub.PreemptJob(pb.PreemptJobRequest(name=job_name(job_id)))

    def logs(self, job_id: str, *, role: str = "", index: int = 0, attempt: int | None = None,
             follow: bool = False) -> Iterator[pb.LogChunk]:
        """What one task wrote; with ``follow``, streamed until the job ends."""
        request = pb.ReadJobLogsRequest(name=job_name(job_id), role=role, index=index, follow=follow)
        if attempt is not None:
            request.attempt = attempt
        return self.stub.ReadJobLogs(request)

    def watch(self, job_id: str = "") -> Iterator[pb.JobChange]:
        """The current status (kind unspecified) of one job or of every job, then each change as it
        happens: of one job until it ends, of every job until the caller stops reading."""
        return self.stub.WatchJobs(pb.WatchJobsRequest(name=job_name(job_id) if job_id else ""))
