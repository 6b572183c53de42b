"""The Pipelines gRPC servicer: parses requests, calls the :class:`~.engine.PipelineEngine`, answers.

Any replica serves it through :class:`~opml_job_orchestrator.access.PipelineAccess`: the leader's
engine, or on a follower the store's records and the leader through a hand-over for every change.

It holds no pipeline logic and publishes no events (the engine and the runner do). Domain errors
become status codes in the shared ObservabilityInterceptor. ForceBless needs the admin role (the
role table); the principal's name goes into the blessing record and the event.
"""

from __future__ import annotations

import re

from opml.jobs.v1 import pipelines_pb2 as pb
from opml.jobs.v1 import pipelines_pb2_grpc

from opml_common.errors import InvalidArgument
from opml_common.grpc.interceptors import current_principal
from opml_common.pagination import paginate
from opml_job_orchestrator.access import PipelineAccess

METHOD_ROLES = {"GetPipeline": "reader", "ListPipelines": "reader", "ListPipelineRuns": "reader",
                "GetPipelineRun": "reader", "ApplyPipeline": "writer", "DeletePipeline": "writer",
                "TriggerPipeline": "writer", "ForceBless": "admin"}

_PIPELINE = re.compile(r"^pipelines/([a-z0-9][a-z0-9-]{0,39})$")
_RUN = re.compile(r"^pipelines/([a-z0-9][a-z0-9-]{0,39})/runs/([1-9][0-9]{0,17})$")
MAX_TRIGGER_REASON = 200


def parse_pipeline_name(field: str, name: str) -> str:
    match = _PIPELINE.match(name)
    if not match:
        raise InvalidArgument(field, f"must look like pipelines/{{pipeline}}, but got {name[:100]!r}")
    return match.group(1)


def parse_run_name(field: str, name: str) -> tuple[str, int]:
    match = _RUN.match(name)
    if not match:
        raise InvalidArgument(field, f"must look like pipelines/{{pipeline}}/runs/{{number}}, but got {name[:100]!r}")
    return match.group(1), int(match.group(2))


class PipelineServicer(pipelines_pb2_grpc.PipelinesServicer):
    def __init__(self, engine: PipelineAccess) -> None:
        self._engine = engine

    async def ApplyPipeline(self, request: pb.ApplyPipelineRequest, context) -> pb.Pipeline:
        if not request.HasField("spec"):
            raise InvalidArgument("spec", "is required")
        return await self._engine.apply(request.spec, principal=current_principal().name)

    async def GetPipeline(self, request: pb.GetPipelineRequest, context) -> pb.Pipeline:
        return await self._engine.get(parse_pipeline_name("name", request.name))

    async def ListPipelines(self, request: pb.ListPipelinesRequest, context) -> pb.ListPipelinesResponse:
        page, token = paginate(await self._engine.pipelines(), request.page_size, request.page_token, query="")
        return pb.ListPipelinesResponse(pipelines=page, next_page_token=token)

    async def DeletePipeline(self, request: pb.DeletePipelineRequest, context) -> pb.DeletePipelineResponse:
        await self._engine.delete(parse_pipeline_name("name", request.name))
        return pb.DeletePipelineResponse()

    async def TriggerPipeline(self, request: pb.TriggerPipelineRequest, context) -> pb.TriggerPipelineResponse:
        name = parse_pipeline_name("name", request.name)
        if len(request.reason) > MAX_TRIGGER_REASON:
            raise InvalidArgument("reason", f"must be at most {MAX_TRIGGER_REASON} characters, "
                                            f"but has {len(request.reason)}")
        about = f"{current_principal().name}" + (f": {request.reason}" if request.reason else "")
        run, coalesced = await self._engine.trigger(name, "rpc", about)
        return pb.TriggerPipelineResponse(run=run, coalesced=coalesced)

    async def ListPipelineRuns(self, request: pb.ListPipelineRunsRequest, context) -> pb.ListPipelineRunsResponse:
        name = parse_pipeline_name("parent", request.parent)
        page, token = paginate(await self._engine.runs(name), request.page_size, request.page_token, query=name)
        return pb.ListPipelineRunsResponse(runs=page, next_page_token=token)

    async def GetPipelineRun(self, request: pb.GetPipelineRunRequest, context) -> pb.PipelineRun:
        return await self._engine.run(*parse_run_name("name", request.name))

    async def ForceBless(self, request: pb.ForceBlessRequest, context) -> pb.PipelineRun:
        name, number = parse_run_name("name", request.name)
        if not request.force:
            raise InvalidArgument("force", "must be true: a forced blessing overrides the evaluation's thresholds")
        return await self._engine.force_bless(name, number, principal=current_principal().name,
                                              reason=request.reason)
