"""Python client of the trace-collector API, used by the CLI, tests and other services.

Failed calls raise the platform's domain errors (``NotFound``, ``FailedPrecondition``...), never
a bare ``grpc.RpcError`` (the :class:`ServiceClient` stub does it, the FetchTrace stream included).
List calls follow the page tokens and return everything. Replies are the API's messages;
the service's ``convert`` module turns them into domain types where a caller wants those.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from google.protobuf.timestamp_pb2 import Timestamp
from opml.traces.v1 import traces_pb2 as pb
from opml.traces.v1 import traces_pb2_grpc

from opml_common.grpc.client import ServiceClient, pages


class TraceCollectorClient(ServiceClient):
    """A blocking client of one trace-collector (``target`` host:port, bearer ``token``); close it, or use
    it as a context manager."""

    stub_class = traces_pb2_grpc.TraceCollectorServiceStub

    def list_jobs(self) -> list[pb.Job]:
        return list(pages(lambda token: self.stub.ListJobs(pb.ListJobsRequest(page_token=token)),
                          lambda reply: reply.jobs))

    def list_runs(self, job: str) -> list[pb.Run]:
        return list(pages(lambda token: self.stub.ListRuns(pb.ListRunsRequest(job=job, page_token=token)),
                          lambda reply: reply.runs))

    def step_series(self, job: str, *, worker: str = "", session_id: str = "", since: Timestamp | None = None,
                    page_size: int = 0) -> list[pb.StepPoint]:
        return list(pages(lambda token: self.stub.GetStepSeries(pb.GetStepSeriesRequest(
            job=job, worker=worker, session_id=session_id, since=since, page_size=page_size, page_token=token)),
            lambda reply: reply.points))

    def summary(self, job: str, *, capture_id: str = "", top_k: int = 0) -> pb.Summary:
        return self.stub.GetSummary(pb.GetSummaryRequest(job=job, capture_id=capture_id, top_k=top_k))

    def capture(self, job: str, steps: int, workers: Sequence[str] = ()) -> pb.Capture:
        return self.stub.CaptureTrace(pb.CaptureTraceRequest(job=job, steps=steps, workers=list(workers)))

    def get_capture(self, capture_id: str) -> pb.Capture:
        return self.stub.GetCapture(pb.GetCaptureRequest(capture_id=capture_id))

    def list_captures(self, job: str) -> list[pb.Capture]:
        return list(pages(lambda token: self.stub.ListCaptures(pb.ListCapturesRequest(job=job, page_token=token)),
                          lambda reply: reply.captures))

    def fetch_trace(self, capture_id: str, worker: str = "") -> Iterator[bytes]:
        """The gzip Chrome trace of one worker of a completed capture, in chunks."""
        for chunk in self.stub.FetchTrace(pb.FetchTraceRequest(capture_id=capture_id, worker=worker)):
            yield chunk.data

    def download_trace(self, capture_id: str, worker: str, destination: Path) -> Path:
        destination.parent.mkdir(parents=True, exist_ok=True)
        with open(destination, "wb") as handle:
            for chunk in self.fetch_trace(capture_id, worker):
                handle.write(chunk)
        return destination

    def set_tracing(self, enabled: bool) -> bool:
        return self.stub.SetTracing(pb.SetTracingRequest(enabled=enabled)).enabled

    def tracing(self) -> bool:
        return self.stub.GetTracing(pb.GetTracingRequest()).enabled
