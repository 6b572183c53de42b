"""GetSummary: the analytics of a job from its step metrics and its latest (or a named) capture.

The step-metrics part costs the same for a job of any size: counts, means and throughput come
from the runs' per-signature aggregates (which cover every step, not only the kept ones), and the
step-time percentiles from at most ``sample_steps`` step records, the newest of each run.

A trace's breakdown is computed once, off the event loop, and cached in Redis beside the capture
record (traces are immutable once announced), so repeated summaries cost one Redis read.
"""

from __future__ import annotations

import asyncio

from opml.traces.v1 import traces_pb2 as pb

from opml_common.errors import DataLoss, InvalidArgument
from opml_trace_collector import analysis
from opml_trace_collector.captures import CaptureManager
from opml_trace_collector.store import Keys, TraceStore
from opml_trace_collector.tracefiles import TraceFiles

MAX_TOP_K = 100


def breakdown_to_proto(breakdown: analysis.Breakdown) -> pb.Breakdown:
    def ops(stats: tuple[analysis.OpStat, ...]) -> list[pb.OpStat]:
        return [pb.OpStat(op_name=s.op_name, op_type=s.op_type, category=s.category, count=s.count,
                          total_s=s.total_s, mean_s=s.mean_s) for s in stats]

    return pb.Breakdown(
        worker=breakdown.worker, source=breakdown.source, steps=breakdown.steps, step_time_s=breakdown.step_time_s,
        step_time_p50_s=breakdown.step_time_p50_s, step_time_p95_s=breakdown.step_time_p95_s,
        computation_s=breakdown.computation_s, communication_s=breakdown.communication_s,
        input_s=breakdown.input_s, idle_s=breakdown.idle_s, communication_total_s=breakdown.communication_total_s,
        examples_per_second=breakdown.examples_per_second, bound=int(breakdown.bound),
        top_ops_by_total=ops(breakdown.top_ops_by_total), top_ops_by_mean=ops(breakdown.top_ops_by_mean))


class Summarizer:
    """Builds GetSummary's answer; caches each trace's breakdown in Redis."""

    def __init__(self, redis, keys: Keys, store: TraceStore, captures: CaptureManager, files: TraceFiles, *,
                 sample_steps: int) -> None:
        if sample_steps < 1:
            raise ValueError(f"Summarizer `sample_steps` must be >= 1, but got {sample_steps}")
        self.redis = redis
        self.keys = keys
        self.store = store
        self.captures = captures
        self.files = files
        self.sample_steps = sample_steps

    async def summary(self, job: str, capture_id: str = "", top_k: int = 0) -> pb.Summary:
        """Raises: NotFound (the job or capture), InvalidArgument (``top_k``, a capture of another job)."""
        if not 0 <= top_k <= MAX_TOP_K:
            raise InvalidArgument("top_k", f"must be in [0, {MAX_TOP_K}] (0: {analysis.DEFAULT_TOP_K}), "
                                           f"but got {top_k}")
        top_k = top_k or analysis.DEFAULT_TOP_K
        await self.store.known_job(job)
        summary = pb.Summary(job=job, metrics=await self.step_metrics(job))
        if capture_id:
            capture = await self.captures.get(capture_id)
            if capture.job != job:
                raise InvalidArgument("capture_id", f"capture {capture_id!r} belongs to job {capture.job!r}, "
                                                    f"not {job!r}")
        else:
            capture = await self.captures.latest_with_traces(job)
        if capture is None:
            return summary
        summary.capture_id = capture.capture_id
        for worker in capture.workers:
            if worker.state == pb.CAPTURE_STATE_COMPLETED:
                breakdown = await self.trace_breakdown(capture.capture_id, worker)
                del breakdown.top_ops_by_total[top_k:]
                del breakdown.top_ops_by_mean[top_k:]
                summary.traces.append(breakdown)
        return summary

    async def step_metrics(self, job: str) -> pb.Breakdown:
        """The breakdown of every step of the job, reading at most ``sample_steps`` step records."""
        runs = await self.store.runs(job)
        sampled = runs[-self.sample_steps:]  # the newest runs when there are more runs than samples
        sample = await self.store.newest_steps([r.session_id for r in sampled],
                                               max(self.sample_steps // max(len(sampled), 1), 1))
        signatures = [s for run in runs for s in run.signatures]
        return breakdown_to_proto(analysis.analyze_signatures(signatures, sample))

    async def trace_breakdown(self, capture_id: str, worker: pb.WorkerCapture) -> pb.Breakdown:
        key = self.keys.analysis(capture_id, worker.worker)
        cached = await self.redis.get(key)
        if cached is not None:
            return pb.Breakdown.FromString(cached)

        def compute() -> pb.Breakdown:
            try:
                trace = analysis.load_trace(self.files.read(worker.trace_url))
            except ValueError as exc:
                raise DataLoss(f"the trace {worker.trace_url} of worker {worker.worker!r} is unreadable: {exc}") from exc
            result = breakdown_to_proto(analysis.analyze_trace(trace, source=worker.trace_url, top_k=MAX_TOP_K))
            result.worker = worker.worker
            return result

        breakdown = await asyncio.to_thread(compute)
        await self.redis.set(key, breakdown.SerializeToString())
        return breakdown
