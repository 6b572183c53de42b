"""GetSummary: the analytics of a job from its step metrics and its latest (or a named) capture.

The step-metrics part costs the same for a job of any size: counts, means and throughput come
from the runs' per-signature aggregates (which cover every step, not only the kept ones), and the
step-time percentiles from at most ``sample_steps`` step records, the newest of each run.

A trace's breakdown is computed once, off the event loop, and cached in Redis beside the capture
record (traces are immutable once announced), so repeated summaries cost one Redis read. Any job
writes its traces, so a trace is read only up to ``max_trace_bytes`` (the object's size checked
first, a gzip inflated as a stream that stops past the cap) and ``max_trace_events``; one over a
cap is refused (FAILED_PRECONDITION) and one that does not parse is DATA_LOSS, each cached like a
breakdown, so a bad trace is read once. The answer is a :class:`opml_trace_collector.model.Summary`
of :class:`analysis.Breakdown` objects.
"""

from __future__ import annotations

import asyncio
import dataclasses

from opml_common.errors import DataLoss, FailedPrecondition, InvalidArgument
from opml_trace_collector import analysis
from opml_trace_collector.captures import CaptureManager
from opml_trace_collector.convert import decode_breakdown, encode_breakdown
from opml_trace_collector.model import CaptureState, Summary, WorkerCapture
from opml_trace_collector.store import Keys, TraceStore
from opml_trace_collector.tracefiles import TraceFiles

MAX_TOP_K = 100
MAX_TRACE_BYTES = 128 * 1024 * 1024
"""The most JSON of one trace GetSummary reads (decompressed); parsing it takes a few times this in memory."""
MAX_TRACE_EVENTS = 1_000_000
"""The most events of one trace GetSummary analyzes (five times a tracer's default ``max_trace_events``)."""
_REFUSALS = {error.code: error for error in (FailedPrecondition, DataLoss)}


class Summarizer:
    """Builds GetSummary's answer; caches each trace's breakdown in Redis."""

    def __init__(self, redis, keys: Keys, store: TraceStore, captures: CaptureManager, files: TraceFiles, *,
                 sample_steps: int, max_trace_bytes: int = MAX_TRACE_BYTES,
                 max_trace_events: int = MAX_TRACE_EVENTS) -> None:
        for name, value in (("sample_steps", sample_steps), ("max_trace_bytes", max_trace_bytes),
                            ("max_trace_events", max_trace_events)):
            if value < 1:
                raise ValueError(f"Summarizer `{name}` must be >= 1, but got {value}")
        self.max_trace_bytes = max_trace_bytes
        self.max_trace_events = max_trace_events
        self.redis = redis
        self.keys = keys
        self.store = store
        self.captures = captures
        self.files = files
        self.sample_steps = sample_steps

    async def summary(self, job: str, capture_id: str = "", top_k: int = 0) -> Summary:
        """Raises: NotFound (the job or capture), InvalidArgument (``top_k``, a capture of another job)."""
        if not 0 <= top_k <= MAX_TOP_K:
            raise InvalidArgument("top_k", f"must be in [0, {MAX_TOP_K}] (0: {analysis.DEFAULT_TOP_K}), "
                                           f"but got {top_k}")
        top_k = top_k or analysis.DEFAULT_TOP_K
        await self.store.known_job(job)
        metrics = await self.step_metrics(job)
        if capture_id:
            capture = await self.captures.get(capture_id)
            if capture.job != job:
                raise InvalidArgument("capture_id", f"capture {capture_id!r} belongs to job {capture.job!r}, "
                                                    f"not {job!r}")
        else:
            capture = await self.captures.latest_with_traces(job)
        if capture is None:
            return Summary(job=job, metrics=metrics)
        traces = []
        for worker in capture.workers:
            if worker.state == CaptureState.COMPLETED:
                breakdown = await self.trace_breakdown(capture.capture_id, worker)
                traces.append(dataclasses.replace(breakdown, top_ops_by_total=breakdown.top_ops_by_total[:top_k],
                                                  top_ops_by_mean=breakdown.top_ops_by_mean[:top_k]))
        return Summary(job=job, metrics=metrics, capture_id=capture.capture_id, traces=tuple(traces))

    async def step_metrics(self, job: str) -> analysis.Breakdown:
        """The breakdown of every step of the job, reading at most ``sample_steps`` step records."""
        runs = await self.store.runs(job)
        sampled = runs[-self.sample_steps:]  # the newest runs when there are more runs than samples
        sample = await self.store.newest_steps([r.session_id for r in sampled],
                                               max(self.sample_steps // max(len(sampled), 1), 1))
        signatures = [s for run in runs for s in run.signatures]
        return analysis.analyze_signatures(signatures, sample)

    async def trace_breakdown(self, capture_id: str, worker: WorkerCapture) -> analysis.Breakdown:
        """The breakdown of one worker's trace, with the ``MAX_TOP_K`` slowest ops (cached, or its refusal).

        Raises:
            FailedPrecondition: the trace is over ``max_trace_bytes`` or ``max_trace_events``.
            DataLoss: the trace is not a readable Chrome trace.
        """
        key, refused_key = self.keys.analysis(capture_id, worker.worker), self.keys.refused_analysis(capture_id,
                                                                                                     worker.worker)
        cached, refused = await self.redis.mget(key, refused_key)
        if cached is not None:
            return decode_breakdown(cached)
        if refused is not None:
            code, _, message = refused.decode().partition("\t")
            raise _REFUSALS[code](message)

        def compute() -> analysis.Breakdown:
            url, name = worker.trace_url, worker.worker
            try:
                data = self.files.read(url, max_bytes=self.max_trace_bytes)
                trace = analysis.load_trace(data, max_bytes=self.max_trace_bytes, max_events=self.max_trace_events)
            except analysis.TraceTooBig as exc:
                raise FailedPrecondition(f"the trace {url} of worker {name!r} is too big to summarize here: {exc}; "
                                         "download it (`opml trace export`) and summarize the file "
                                         "(`opml trace summary FILE`)") from exc
            except ValueError as exc:
                raise DataLoss(f"the trace {url} of worker {name!r} is unreadable: {exc}") from exc
            return dataclasses.replace(analysis.analyze_trace(trace, source=url, top_k=MAX_TOP_K),
                                       worker=name, step_times_s=())  # as cached

        try:
            breakdown = await asyncio.to_thread(compute)
        except (FailedPrecondition, DataLoss) as exc:
            await self.redis.set(refused_key, f"{exc.code}\t{exc.message}")
            raise
        await self.redis.set(key, encode_breakdown(breakdown))
        return breakdown
