"""Python client of the trace-collector API, used by the CLI, tests and other services.

Failed calls raise the platform's domain errors (``NotFound``, ``FailedPrecondition``...), never
a bare ``grpc.RpcError``. List calls follow the page tokens and return everything.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from google.protobuf.timestamp_pb2 import Timestamp
from opml.traces.v1 import traces_pb2 as pb
from opml.traces.v1 import traces_pb2_grpc

from opml_common.grpc.client import open_channel, raising_domain_errors, stream_raising_domain_errors


class TraceCollectorClient:
    """A blocking client of one trace-collector (``target`` host:port, bearer ``token``); close it, or use
    it as a context manager."""

    def __init__(self, target: str, *, token: str | None = None) -> None:
        self._channel = open_channel(target, token=token)
        self._stub = traces_pb2_grpc.TraceCollectorServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "TraceCollectorClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @raising_domain_errors
    def list_jobs(self) -> list[pb.Job]:
        jobs, token = [], ""
        while True:
            reply = self._stub.ListJobs(pb.ListJobsRequest(page_token=token))
            jobs.extend(reply.jobs)
            if not (token := reply.next_page_token):
                return jobs

    @raising_domain_errors
    def list_runs(self, job: str) -> list[pb.Run]:
        runs, token = [], ""
        while True:
            reply = self._stub.ListRuns(pb.ListRunsRequest(job=job, page_token=token))
            runs.extend(reply.runs)
            if not (token := reply.next_page_token):
                return runs

    @raising_domain_errors
    def step_series(self, job: str, *, worker: str = "", session_id: str = "", since: Timestamp | None = None,
                    page_size: int = 0) -> list[pb.StepPoint]:
        points, token = [], ""
        while True:
            reply = self._stub.GetStepSeries(pb.GetStepSeriesRequest(
                job=job, worker=worker, session_id=session_id, since=since, page_size=page_size, page_token=token))
            points.extend(reply.points)
            if not (token := reply.next_page_token):
                return points

    @raising_domain_errors
    def summary(self, job: str, *, capture_id: str = "", top_k: int = 0) -> pb.Summary:
        return self._stub.GetSummary(pb.GetSummaryRequest(job=job, capture_id=capture_id, top_k=top_k))

    @raising_domain_errors
    def capture(self, job: str, steps: int, workers: Sequence[str] = ()) -> pb.Capture:
        return self._stub.CaptureTrace(pb.CaptureTraceRequest(job=job, steps=steps, workers=list(workers)))

    @raising_domain_errors
    def get_capture(self, capture_id: str) -> pb.Capture:
        return self._stub.GetCapture(pb.GetCaptureRequest(capture_id=capture_id))

    @raising_domain_errors
    def list_captures(self, job: str) -> list[pb.Capture]:
        captures, token = [], ""
        while True:
            reply = self._stub.ListCaptures(pb.ListCapturesRequest(job=job, page_token=token))
            captures.extend(reply.captures)
            if not (token := reply.next_page_token):
                return captures

    def fetch_trace(self, capture_id: str, worker: str = "") -> Iterator[bytes]:
        """The gzip Chrome trace of one worker of a completed capture, in chunks."""
        stream = self._stub.FetchTrace(pb.FetchTraceRequest(capture_id=capture_id, worker=worker))
        for chunk in stream_raising_domain_errors(stream):
            yield chunk.data

    def download_trace(self, capture_id: str, worker: str, destination: Path) -> Path:
        destination.parent.mkdir(parents=True, exist_ok=True)
        with open(destination, "wb") as handle:
            for chunk in self.fetch_trace(capture_id, worker):
                handle.write(chunk)
        return destination

    @raising_domain_errors
    def set_tracing(self, enabled: bool) -> bool:
        return self._stub.SetTracing(pb.SetTracingRequest(enabled=enabled)).enabled

    @raising_domain_errors
    def tracing(self) -> bool:
        return self._stub.GetTracing(pb.GetTracingRequest()).enabled
