"""Python client of the job-orchestrator's Pipelines API, used by ``opml pipeline``.

Failed calls raise the platform's domain errors (``NotFound``, ``InvalidArgument``...), never a
bare ``grpc.RpcError``.
"""

from __future__ import annotations

from opml.jobs.v1 import pipelines_pb2 as pb
from opml.jobs.v1 import pipelines_pb2_grpc

from opml_common.grpc.client import ServiceClient, pages
from opml_job_orchestrator_contract.names import pipeline_name, run_name


class PipelineClient(ServiceClient):
    stub_class = pipelines_pb2_grpc.PipelinesStub

    def apply(self, spec: pb.PipelineSpec) -> pb.Pipeline:
        return self.stub.ApplyPipeline(pb.ApplyPipelineRequest(spec=spec))

    def get(self, pipeline: str) -> pb.Pipeline:
        return self.stub.GetPipeline(pb.GetPipelineRequest(name=pipeline_name(pipeline)))

    def list(self) -> list[pb.Pipeline]:
        return list(pages(lambda token: self.stub.ListPipelines(pb.ListPipelinesRequest(page_token=token)),
                          lambda reply: reply.pipelines))

    def delete(self, pipeline: str) -> None:
        self.stub.DeletePipeline(pb.DeletePipelineRequest(name=pipeline_name(pipeline)))

    def trigger(self, pipeline: str, reason: str = "") -> pb.TriggerPipelineResponse:
        return self.stub.TriggerPipeline(pb.TriggerPipelineRequest(name=pipeline_name(pipeline), reason=reason))

    def runs(self, pipeline: str) -> list[pb.PipelineRun]:
        """Every run, newest first."""
        return list(pages(lambda token: self.stub.ListPipelineRuns(pb.ListPipelineRunsRequest(
            parent=pipeline_name(pipeline), page_token=token)), lambda reply: reply.runs))

    def run(self, pipeline: str, run: int) -> pb.PipelineRun:
        return self.stub.GetPipelineRun(pb.GetPipelineRunRequest(name=run_name(pipeline, run)))

    def force_bless(self, pipeline: str, run: int, reason: str) -> pb.PipelineRun:
        """Needs the admin role."""
        return self.stub.ForceBless(pb.ForceBlessRequest(name=run_name(pipeline, run), force=True, reason=reason))
