"""The trace-collector SIGKILLed while it aggregates (issue 12, item 6): nothing lost, nothing twice.

A tracer's first half of step batches is published to the real broker and applied (the run counts
them all); the collector is SIGKILLed at once, so offsets of batches it applied may not be committed
and are delivered again. The second half follows, with ten batches of the first half re-sent (as a
tracer re-sends its spool, under new event ids) and the run's end. The collector started again over
the same Redis counts every step exactly once: the run ends STOPPED with all its steps and no gap.
"""

from __future__ import annotations

import asyncio

import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from opml.traces.v1 import events_pb2
from opml.traces.v1 import traces_pb2 as pb

from opml_common.bus import CloudEvent, EventPublisher
from opml_common.config import PlatformSettings
from opml_common.errors import NotFound
from opml_devstack.testing.bus import fresh_metrics, poll_until
from opml_devstack.testing.services import TOKENS
from opml_trace_collector_contract.client import TraceCollectorClient
from opml_trace_collector_contract.topics import TRACES, tracer_source

pytestmark = pytest.mark.timeout(300)

JOB, WORKER, SESSION = "crash-aggregation", "worker-0", "s-crash"
BATCHES, STEPS_PER_BATCH = 60, 20
T0_US = 1_700_000_000_000_000


def _batch(sequence: int) -> events_pb2.StepMetricsBatch:
    records = []
    for step in range(sequence * STEPS_PER_BATCH, (sequence + 1) * STEPS_PER_BATCH):
        start = Timestamp()
        start.FromMicroseconds(T0_US + step * 10_000)
        records.append(events_pb2.StepRecord(step=step, kind=events_pb2.STEP_KIND_TRAIN, signature="keras.fit",
                                             start_time=start, duration_s=0.01, input_wait_s=0.001, examples=32))
    return events_pb2.StepMetricsBatch(job=JOB, worker=WORKER, session_id=SESSION, sequence=sequence, steps=records)


def _publish(settings: PlatformSettings, messages: list) -> None:
    async def send() -> None:
        async with EventPublisher(settings, source="opml/tracer-test", metrics=fresh_metrics("tracer-test")[0]) as pub:
            for message in messages:
                await pub.publish(TRACES, CloudEvent.from_proto(message, subject=f"{JOB}/{WORKER}",
                                                                source=tracer_source(JOB, WORKER)))

    asyncio.run(send())


def _run(target: str) -> pb.Run | None:
    """The run as the collector reports it; None before its first event is applied."""
    with TraceCollectorClient(target, token=TOKENS["reader"]) as client:
        try:
            runs = client.list_runs(JOB)
        except NotFound:
            return None
    return runs[0] if runs else None


def test_a_collector_killed_while_aggregating_counts_every_step_once(start_service, platform_settings,
                                                                    unique_prefix: str) -> None:
    env = start_service.env("trace-collector", extra_env={"OPML_TRACE_COLLECTOR_BUCKET": unique_prefix.rstrip("-")})
    collector = start_service("trace-collector", env=env)
    half = BATCHES // 2
    _publish(platform_settings, [events_pb2.TracerStarted(job=JOB, worker=WORKER, session_id=SESSION,
                                                          tf_version="2.21.0"),
                                 *[_batch(sequence) for sequence in range(half)]])
    poll_until(lambda: (run := _run(collector.target)) and run.steps == half * STEPS_PER_BATCH, timeout_s=60,
               what="the first half applied", every_s=0.02)
    collector.kill()  # SIGKILL while its consumer commits what it applied

    resent = [_batch(sequence) for sequence in range(half - 10, half)]  # a tracer's spool, sent again
    _publish(platform_settings, [*[_batch(sequence) for sequence in range(half, BATCHES)], *resent,
                                 events_pb2.TracerStopped(job=JOB, worker=WORKER, session_id=SESSION,
                                                          steps=BATCHES * STEPS_PER_BATCH, exit_code=0)])
    collector = start_service("trace-collector", env=env)  # the same Redis keys and consumer group
    # TracerStopped is the last event of the run's partition: once it is applied, every earlier one was.
    run = poll_until(lambda: (run := _run(collector.target)) and run.state == pb.RUN_STATE_STOPPED and run,
                     timeout_s=120, what="the run's end applied", every_s=0.1)
    assert (run.steps, run.missing_batches) == (BATCHES * STEPS_PER_BATCH, 0)
    with TraceCollectorClient(collector.target, token=TOKENS["reader"]) as client:
        [job] = [job for job in client.list_jobs() if job.job == JOB]
    assert job.steps == BATCHES * STEPS_PER_BATCH
