"""The TraceCollectorService gRPC servicer, thin: parses each request, calls the transport-free core
(:mod:`store`, :mod:`captures`, :mod:`summary`, :mod:`tracefiles`) and converts its domain types to
the reply (:mod:`convert`). Domain errors become status codes in the shared ObservabilityInterceptor.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from opml.traces.v1 import traces_pb2 as pb
from opml.traces.v1 import traces_pb2_grpc

from opml_common.errors import InvalidArgument
from opml_common.grpc.interceptors import current_principal
from opml_common.pagination import paginate
from opml_trace_collector import convert
from opml_trace_collector.captures import CaptureManager
from opml_trace_collector.store import TraceStore, check_name
from opml_trace_collector.summary import Summarizer
from opml_trace_collector.tracefiles import TraceFiles

# Roles per method; every other method needs the writer role (none here: the tracers write through Kafka).
METHOD_ROLES = {
    "ListJobs": "reader", "ListRuns": "reader", "GetStepSeries": "reader", "GetSummary": "reader",
    "GetCapture": "reader", "ListCaptures": "reader", "FetchTrace": "reader", "GetTracing": "reader",
    "CaptureTrace": "admin", "SetTracing": "admin",
}
SERIES_DEFAULT_PAGE, SERIES_MAX_PAGE = 1000, 10000


class TraceCollectorServicer(traces_pb2_grpc.TraceCollectorServiceServicer):
    """Checks each request's fields and delegates; the roles are in METHOD_ROLES."""

    def __init__(self, store: TraceStore, captures: CaptureManager, summarizer: Summarizer,
                 files: TraceFiles) -> None:
        self._store = store
        self._captures = captures
        self._summarizer = summarizer
        self._files = files

    async def ListJobs(self, request: pb.ListJobsRequest, context) -> pb.ListJobsResponse:
        names, token = paginate(await self._store.job_names(), request.page_size, request.page_token)
        jobs = await self._store.jobs(names)
        return pb.ListJobsResponse(jobs=[convert.job_to_proto(j) for j in jobs], next_page_token=token)

    async def ListRuns(self, request: pb.ListRunsRequest, context) -> pb.ListRunsResponse:
        job = await self._store.known_job(request.job)
        sessions, token = paginate(await self._store.session_ids(job), request.page_size, request.page_token,
                                   query=job)
        runs = await self._store.runs(job, sessions)
        return pb.ListRunsResponse(runs=[convert.run_to_proto(r) for r in runs], next_page_token=token)

    async def GetStepSeries(self, request: pb.GetStepSeriesRequest, context) -> pb.GetStepSeriesResponse:
        job = await self._store.known_job(request.job)
        if request.worker:
            check_name("worker", request.worker)
        if request.page_size < 0:
            raise InvalidArgument("page_size", f"must be >= 0, but got {request.page_size}")
        size = min(request.page_size or SERIES_DEFAULT_PAGE, SERIES_MAX_PAGE)
        since_us = request.since.ToMicroseconds() if request.HasField("since") else 0
        query = json.dumps([job, request.worker, request.session_id, since_us])
        cursor = convert.series_cursor(request.page_token, query) if request.page_token else None
        points, following = await self._store.series(job, worker=request.worker, session=request.session_id,
                                                     since_us=since_us, page_size=size, cursor=cursor)
        return pb.GetStepSeriesResponse(points=[convert.step_point_to_proto(p) for p in points],
                                        next_page_token=convert.series_token(following, query) if following else "")

    async def GetSummary(self, request: pb.GetSummaryRequest, context) -> pb.Summary:
        if request.capture_id:
            check_name("capture_id", request.capture_id)
        summary = await self._summarizer.summary(check_name("job", request.job), request.capture_id, request.top_k)
        return convert.summary_to_proto(summary)

    async def CaptureTrace(self, request: pb.CaptureTraceRequest, context) -> pb.Capture:
        job = check_name("job", request.job)
        for index, worker in enumerate(request.workers):
            check_name(f"workers[{index}]", worker)
        capture = await self._captures.arm(job, request.steps, list(request.workers), current_principal().name)
        return convert.capture_to_proto(capture)

    async def GetCapture(self, request: pb.GetCaptureRequest, context) -> pb.Capture:
        return convert.capture_to_proto(await self._captures.get(check_name("capture_id", request.capture_id)))

    async def ListCaptures(self, request: pb.ListCapturesRequest, context) -> pb.ListCapturesResponse:
        job = await self._store.known_job(request.job)
        ids, token = paginate(await self._captures.ids(job), request.page_size, request.page_token, query=job)
        captures = await asyncio.gather(*(self._captures.get(i) for i in ids))
        return pb.ListCapturesResponse(captures=[convert.capture_to_proto(c) for c in captures], next_page_token=token)

    async def FetchTrace(self, request: pb.FetchTraceRequest, context) -> AsyncIterator[pb.TraceChunk]:
        url = await self._captures.trace_url(check_name("capture_id", request.capture_id), request.worker)
        chunks = self._files.chunks(url)
        end = object()
        try:
            while (chunk := await asyncio.to_thread(next, chunks, end)) is not end:
                yield pb.TraceChunk(data=chunk)
        finally:
            await asyncio.to_thread(chunks.close)  # a caller that goes away releases the S3 connection

    async def SetTracing(self, request: pb.SetTracingRequest, context) -> pb.TracingState:
        await self._store.set_tracing(request.enabled)
        return pb.TracingState(enabled=request.enabled)

    async def GetTracing(self, request: pb.GetTracingRequest, context) -> pb.TracingState:
        return pb.TracingState(enabled=await self._store.tracing_enabled())
