"""The transport-free core on the test Redis, without the service: the store, the capture manager and
the summarizer take and return the domain types of opml_trace_collector.model."""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import re
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from opml_common.bus import CloudEvent, MalformedEvent
from opml_common.errors import FailedPrecondition, InvalidArgument, NotFound
from opml_common.storage import s3_client
from opml_devstack.testing.bus import fresh_metrics, sample
from opml_trace_collector import model
from opml_trace_collector.aggregator import Aggregator
from opml_trace_collector.analysis import Bound
from opml_trace_collector.captures import CaptureManager, trace_prefix
from opml_trace_collector.convert import event_to_proto
from opml_trace_collector.store import BatchEffect, Keys, TraceStore
from opml_trace_collector.summary import Summarizer
from opml_trace_collector.tracefiles import TraceFiles
from opml_trace_collector_contract.topics import tracer_source

JOB, BUCKET = "mnist", "traces-bucket"
T0 = 1_700_000_000.0
TRACE = {"traceEvents": [
    {"ph": "X", "cat": "step", "name": "step 1", "ts": 0, "dur": 1000},
    {"ph": "X", "cat": "op", "name": "it", "ts": 0, "dur": 500, "args": {"op_type": "IteratorGetNext"}},
    {"ph": "X", "cat": "op", "name": "dense/MatMul", "ts": 500, "dur": 400, "args": {"op_type": "MatMul"}}]}


def _batch(session: str, sequence: int, *durations: float, worker: str = "w0") -> model.StepBatch:
    steps = tuple(model.StepRecord(step=sequence * 10 + i, kind=model.StepKind.TRAIN, signature="keras.fit",
                                   start_ns=int((T0 + sequence * 10 + i) * 1e9), duration_s=d, input_wait_s=0.0,
                                   examples=32) for i, d in enumerate(durations))
    return model.StepBatch(job=JOB, worker=worker, session_id=session, sequence=sequence, steps=steps,
                           host=(model.HostSample(time_s=T0, cpu_percent=50.0, rss_bytes=1024),))


class _Files:
    """TraceFiles' read, from memory; counts the reads."""

    def __init__(self) -> None:
        self.reads = 0

    def read(self, url: str, **bounds: int) -> bytes:
        self.reads += 1
        return gzip.compress(json.dumps(TRACE).encode())


@pytest.fixture
async def core(settings_env: dict[str, str]) -> AsyncIterator[tuple]:
    client = aioredis.Redis.from_url(settings_env["OPML_REDIS_URL"])
    keys = Keys(settings_env["OPML_REDIS_PREFIX"])
    metrics, registry = fresh_metrics("trace-collector")
    store = TraceStore(client, keys, series_length=100, run_lost_after_s=1e12)
    captures = CaptureManager(client, keys, store, bucket=BUCKET, timeout_s=60, metrics=metrics)
    files = _Files()
    summarizer = Summarizer(client, keys, store, captures, files, sample_steps=100)  # type: ignore[arg-type]
    yield store, captures, summarizer, files, registry
    await client.aclose()


async def test_the_store_applies_each_batch_once_and_reads_domain_types(core) -> None:
    store, *_ = core
    await store.record_started(model.TracerStarted(job=JOB, worker="w0", session_id="s1", tf_version="2.21.0",
                                                   patched=("keras.Model.fit",), pid=7, argv=("python", "t.py")), T0)
    second, first = _batch("s1", 1, 0.3), _batch("s1", 0, 0.1, 0.2)
    assert (await store.apply_batch(second, T0 + 2)) == BatchEffect(applied=True, steps=1, newest=True,
                                                                     examples_per_second=pytest.approx(32 / 0.3))
    assert (await store.apply_batch(first, T0 + 1)).applied and not (await store.apply_batch(second, T0 + 3)).applied
    [run] = await store.runs(JOB)
    assert isinstance(run, model.Run) and run.state == model.RunState.RUNNING and run.stopped is None
    assert (run.worker, run.steps, run.batches, run.missing_batches, run.patched, run.argv) == (
        "w0", 3, 2, 0, ("keras.Model.fit",), ("python", "t.py"))
    assert (run.started, run.last_seen, run.cpu_percent, run.rss_bytes) == (T0, T0 + 2, 50.0, 1024)
    [signature] = run.signatures
    assert (signature.signature, signature.count, signature.examples) == ("keras.fit", 3, 96)
    assert signature.mean_s == pytest.approx(0.2)
    points, following = await store.series(JOB, page_size=2)
    assert [p.record for p in points] == [*first.steps] and following is not None
    rest, following = await store.series(JOB, page_size=2, cursor=following)
    assert [p.record for p in rest] == [*second.steps] and following is None
    [job] = await store.jobs(await store.job_names())
    assert (job.job, job.run_count, job.running_runs, job.steps, job.first_seen, job.last_seen) == (
        JOB, 1, 1, 3, T0, T0 + 2)
    await store.record_stopped(model.TracerStopped(job=JOB, worker="w0", session_id="s1", steps=3, exit_code=0), T0 + 4)
    [run] = await store.runs(JOB)
    assert run.state == model.RunState.STOPPED and run.stopped == T0 + 4


async def test_captures_follow_the_answers_and_name_the_trace_to_serve(core) -> None:
    store, captures, _, _, registry = core
    for worker, session in (("w0", "s0"), ("w1", "s1")):
        await store.apply_batch(_batch(session, 0, 0.1, worker=worker), T0)
    with pytest.raises(InvalidArgument) as bad:
        await captures.arm(JOB, 0, [], "me")
    assert bad.value.field == "steps"
    armed = await captures.arm(JOB, 2, [], "me")
    assert isinstance(armed, model.Capture) and armed.state == model.CaptureState.PENDING and armed.end_time is None
    assert [(w.worker, w.state) for w in armed.workers] == [("w0", model.CaptureState.PENDING),
                                                           ("w1", model.CaptureState.PENDING)]
    with pytest.raises(FailedPrecondition, match="no completed trace yet"):
        await captures.trace_url(armed.capture_id)
    prefix = trace_prefix(BUCKET, JOB, armed.capture_id)
    with pytest.raises(MalformedEvent, match="trace_url must be under"):
        await captures.on_completed(model.TraceStored(job=JOB, worker="w0", capture_id=armed.capture_id,
                                                      trace_url="s3://elsewhere/x"), T0)
    for worker in ("w0", "w1"):
        stored = model.TraceStored(job=JOB, worker=worker, capture_id=armed.capture_id,
                                   trace_url=f"{prefix}{worker}.trace.json.gz", first_step=1, steps=2, size_bytes=9)
        await captures.on_completed(stored, T0 + 5)
        await captures.on_completed(stored, T0 + 6)  # a repeat changes nothing
    done = await captures.get(armed.capture_id)
    assert done.state == model.CaptureState.COMPLETED and done.end_time == T0 + 5
    assert [(w.worker, w.state, w.size_bytes) for w in done.workers] == [
        ("w0", model.CaptureState.COMPLETED, 9), ("w1", model.CaptureState.COMPLETED, 9)]
    assert await captures.trace_url(armed.capture_id, "w1") == f"{prefix}w1.trace.json.gz"
    with pytest.raises(InvalidArgument) as several:
        await captures.trace_url(armed.capture_id)
    assert several.value.field == "worker"
    with pytest.raises(NotFound, match="worker 'w9'"):
        await captures.trace_url(armed.capture_id, "w9")
    assert await captures.latest_with_traces(JOB) == done
    assert sample(registry, "opml_trace_collector_captures_total", outcome="completed") == 1


async def test_the_summary_breaks_a_trace_down_once_and_caps_the_ops(core) -> None:
    store, captures, summarizer, files, _ = core
    await store.apply_batch(_batch("s0", 0, 0.1, 0.3), T0)
    empty = await summarizer.summary(JOB)
    assert isinstance(empty, model.Summary) and empty.capture_id == "" and empty.traces == ()
    assert (empty.metrics.steps, empty.metrics.step_time_s) == (2, pytest.approx(0.2))
    armed = await captures.arm(JOB, 1, [], "me")
    await captures.on_completed(model.TraceStored(
        job=JOB, worker="w0", capture_id=armed.capture_id,
        trace_url=trace_prefix(BUCKET, JOB, armed.capture_id) + "w0.trace.json.gz"), T0 + 1)
    summary = await summarizer.summary(JOB, top_k=1)
    [trace] = summary.traces
    assert (summary.capture_id, trace.worker, trace.steps, trace.bound) == (armed.capture_id, "w0", 1, Bound.INPUT)
    assert [op.op_name for op in trace.top_ops_by_total] == ["it"]
    again = await summarizer.summary(JOB, capture_id=armed.capture_id, top_k=1)
    assert again.traces == summary.traces and files.reads == 1  # the breakdown is cached
    with pytest.raises(InvalidArgument) as bad:
        await summarizer.summary(JOB, top_k=101)
    assert bad.value.field == "top_k"


def _with_step(batch: model.StepBatch, index: int, **values: object) -> model.StepBatch:
    steps = list(batch.steps)
    steps[index] = dataclasses.replace(steps[index], **values)
    return dataclasses.replace(batch, steps=tuple(steps))


@pytest.mark.parametrize("bad", [{"duration_s": float("nan")}, {"input_wait_s": float("inf")},
                                 {"examples": 2 ** 63 - 1}], ids=["nan-duration", "inf-wait", "huge-examples"])
async def test_a_batch_the_script_cannot_apply_changes_nothing(core, bad: dict) -> None:
    """Redis does not roll a script back: a number it would refuse is refused before the first write,
    so nothing is half applied and the sequence is not taken (the good batch counts, not as a repeat)."""
    store, *_ = core
    good = _batch("s1", 0, 0.1, 0.2)
    with pytest.raises(aioredis.ResponseError, match="nothing applied"):
        await store.apply_batch(_with_step(good, 1, **bad), T0)
    assert await store.job_names() == [] and await store.redis.exists(
        *(key("s1") for key in (store.keys.run_info, store.keys.run_seqs, store.keys.run_sigs,
                                          store.keys.run_series))) == 0
    assert (await store.apply_batch(good, T0)).applied


@pytest.mark.parametrize("bad, field", [({"duration_s": float("nan")}, "steps[1].duration_s"),
                                        ({"duration_s": -0.5}, "steps[1].duration_s"),
                                        ({"input_wait_s": float("-inf")}, "steps[1].input_wait_s"),
                                        ({"examples": 2 ** 62}, "steps[1].examples"),
                                        ({"examples": -1}, "steps[1].examples")])
async def test_the_aggregator_dead_letters_a_batch_with_numbers_out_of_range(core, bad: dict, field: str) -> None:
    store, captures, *_ = core
    aggregator = Aggregator(store, captures, fresh_metrics("trace-collector")[0])
    good = _batch("s1", 0, 0.1, 0.2)

    def event(batch: model.StepBatch) -> CloudEvent:
        return CloudEvent.from_proto(event_to_proto(batch), source=tracer_source(JOB, "w0"), subject=f"{JOB}/w0")

    with pytest.raises(MalformedEvent, match=re.escape(field)):
        await aggregator.handle(event(_with_step(good, 1, **bad)))
    assert await store.job_names() == []
    await aggregator.handle(event(good))
    assert [run.steps for run in await store.runs(JOB)] == [2]


class _CountedFiles(TraceFiles):
    """The real S3 TraceFiles; counts the objects read."""

    reads = 0

    def read(self, url: str, **bounds: int) -> bytes:
        self.reads += 1
        return super().read(url, **bounds)


async def test_a_trace_too_big_to_summarize_is_refused_bounded_and_the_refusal_cached(
        core, platform_settings, bucket: str) -> None:
    """Any job writes under traces/: a gzip bomb, an object over the cap and a trace of too many events
    are refused (FAILED_PRECONDITION, with the cap) without holding more than the cap, and once each."""
    store, _, _, _, registry = core
    files = _CountedFiles(s3_client(platform_settings), bucket)
    files.ensure_bucket()
    metrics, _ = fresh_metrics("trace-collector")
    captures = CaptureManager(store.redis, store.keys, store, bucket=bucket, timeout_s=60, metrics=metrics)
    summarizer = Summarizer(store.redis, store.keys, store, captures, files, sample_steps=100,
                            max_trace_bytes=1 << 20, max_trace_events=1000)
    many = {"traceEvents": [{"ph": "X", "cat": "op", "name": "op", "ts": i, "dur": 1} for i in range(1001)]}
    objects = {"bomb": gzip.compress(b'{"traceEvents": [' + b" " * (16 << 20) + b"]}"),  # 16 KiB: 16 MiB inflated
               "large": b'{"traceEvents": [' + b" " * (2 << 20) + b"]}",
               "many": gzip.compress(json.dumps(many).encode())}
    for worker in objects:
        await store.apply_batch(_batch(f"s-{worker}", 0, 0.1, worker=worker), T0)
    armed = await captures.arm(JOB, 1, [], "me")
    for worker, data in objects.items():
        key = f"traces/{JOB}/{armed.capture_id}/{worker}.trace.json.gz"
        files.s3.put_object(bucket, key, io.BytesIO(data), len(data))
        await captures.on_completed(model.TraceStored(job=JOB, worker=worker, capture_id=armed.capture_id,
                                                      trace_url=f"s3://{bucket}/{key}"), T0 + 1)
    workers = {w.worker: w for w in (await captures.get(armed.capture_id)).workers}
    for worker, cap in (("bomb", "over the 1048576 bytes"), ("large", r"object is \d+ bytes, over the 1048576"),
                        ("many", "1001 events, over the 1000")):
        for _ in range(2):
            with pytest.raises(FailedPrecondition, match=f"worker '{worker}'.*{cap}.*export"):
                await summarizer.trace_breakdown(armed.capture_id, workers[worker])
    assert files.reads == 3  # each trace read once: the refusal is cached like a breakdown
    with pytest.raises(FailedPrecondition, match="worker 'bomb'"):
        await summarizer.summary(JOB)
