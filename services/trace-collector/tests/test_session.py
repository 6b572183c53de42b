"""The session file (JSON lines of StepRecords): a lossless round trip, plain and gzip."""

from __future__ import annotations

import json
import random

import pytest
from google.protobuf import json_format
from google.protobuf.timestamp_pb2 import Timestamp
from opml.traces.v1 import events_pb2 as pb
from opml.traces.v1.events_pb2 import STEP_KIND_PREDICT, STEP_KIND_TRAIN, StepRecord

from opml_trace_collector.inject.recorder import Step
from opml_trace_collector.inject.tracer import Tracer
from opml_trace_collector.session import is_session_file, read_session, record_to_line, step_to_line, write_session


def _records() -> list[StepRecord]:
    records = []
    for step in range(50):
        start = Timestamp()
        start.FromNanoseconds(1_700_000_000_123_456_789 + step * 10_000_000)
        records.append(StepRecord(step=step, kind=STEP_KIND_TRAIN if step % 5 else STEP_KIND_PREDICT,
                                  signature="tf.function:train_step", start_time=start,
                                  duration_s=0.01 + step * 1e-4, input_wait_s=step * 1e-5, examples=64))
    return records


@pytest.mark.parametrize("name", ["run.jsonl", "run.jsonl.gz"])
def test_round_trip_is_lossless(tmp_path, name: str) -> None:
    path = tmp_path / "nested" / name
    records = _records()
    assert write_session(path, records) == 50
    assert is_session_file(path)
    assert read_session(path) == records


def test_lines_are_protobuf_json_one_record_each(tmp_path) -> None:
    path = tmp_path / "run.jsonl"
    write_session(path, _records()[:2])
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert first["signature"] == "tf.function:train_step" and first["kind"] == "STEP_KIND_PREDICT"
    assert first["startTime"].startswith("2023-11-14T22:13:20.123456789")


def test_a_bad_line_names_the_file_and_line(tmp_path) -> None:
    path = tmp_path / "run.jsonl"
    write_session(path, _records()[:1])
    with open(path, "a") as handle:
        handle.write('{"durationS": "slow"}\n')
    with pytest.raises(ValueError, match=r"run.jsonl:2: not a StepRecord"):
        read_session(path)


def test_the_tracers_fast_line_is_protobufs_json_mapping_of_the_same_step() -> None:
    # The tracer writes step_to_line(*step); offline tools and json_format read record_to_line's format.
    rng = random.Random(7)
    starts = [0.0, 1.5, 1_796_000_000.0, 1_796_000_000.123, 1_796_000_000.123456, 1_796_000_000.000000789]
    steps = [Step(0, 0, "", 0.0, 0.0, 0.0, 0), Step(1, 5, 'tf.function:"quoted" \u00e9', 2.0, 1e-9, 3.5e-7, 1)]
    steps += [Step(rng.randrange(0, 10**12), rng.randrange(0, 6), rng.choice(["keras.fit", "session.run:a,b", ""]),
                   rng.choice(starts) + rng.random() * rng.choice([0, 1, 1e3]), rng.random() * rng.choice([0, 1e-3, 10]),
                   rng.random() * rng.choice([0, 1e-4]), rng.randrange(0, 4096)) for _ in range(2000)]
    batch = pb.StepMetricsBatch()
    Tracer.add_steps(batch.steps, steps)
    for step, record in zip(steps, batch.steps, strict=True):
        stamp = Timestamp()
        stamp.FromNanoseconds(int(step.start_time * 1e9))
        assert record.start_time == stamp, step
        assert step_to_line(*step) == record_to_line(record), step
        assert json_format.ParseDict(json.loads(step_to_line(*step)), pb.StepRecord()) == record
