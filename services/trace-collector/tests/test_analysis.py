"""The analytics on hand-built Chrome traces and step records whose breakdown is known exactly."""

from __future__ import annotations

import gzip
import json

import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from opml.traces.v1.events_pb2 import STEP_KIND_EVALUATE, STEP_KIND_FUNCTION, STEP_KIND_TRAIN, StepRecord
from opml.traces.v1.traces_pb2 import SignatureStats

from opml_trace_collector.analysis import (
    COMMUNICATION,
    COMPUTATION,
    INPUT,
    Bound,
    analyze_signatures,
    analyze_steps,
    analyze_trace,
    classify,
    load_trace,
    op_category,
    percentile,
    trace_step_times,
)


def _step(n: int, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "step", "name": f"step {n}", "ts": ts, "dur": dur, "pid": 1, "tid": 1}


def _op(op_type: str, ts: float, dur: float, name: str | None = None, tid: int = 2) -> dict:
    name = name or op_type.lower()
    return {"ph": "X", "cat": "op", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid,
            "args": {"op_type": op_type, "op_name": name}}


def _trace(*events: dict) -> dict:
    return {"traceEvents": [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "host"}}, *events],
            "displayTimeUnit": "ms", "metadata": {"job": "j", "worker": "worker-0", "capture_id": "c", "first_step": 3,
                                                  "steps": 2, "tf_version": "2.21.0"}}


@pytest.mark.parametrize("op_type, category", [
    ("MatMul", COMPUTATION), ("Conv2DBackpropFilter", COMPUTATION), ("CollectiveReduceV2", COMMUNICATION),
    ("CollectiveGatherV2", COMMUNICATION), ("NcclAllReduce", COMMUNICATION), ("_Recv", COMMUNICATION),
    ("_HostSend", COMMUNICATION), ("RecvTensor", COMMUNICATION), ("HorovodAllreduce", COMMUNICATION),
    ("IteratorGetNext", INPUT), ("MapDataset", INPUT), ("ParallelMapDatasetV2", INPUT), ("DatasetCardinality",
                                                                                          COMPUTATION),
])
def test_op_categories(op_type: str, category: str) -> None:
    assert op_category(op_type) == category


def test_breakdown_parts_add_up_to_the_step_time_with_overlaps_counted_once() -> None:
    # Step 0: [0, 1000) µs. Input 0-200; compute 200-700 on two threads (overlapping 300-600);
    # all-reduce 600-900 (hidden 600-700 under compute, exposed 700-900); idle 900-1000.
    # Step 1: [1000, 2000). Input 1000-1500 of which 1400-1500 under compute; compute 1400-1800; idle 1800-2000.
    trace = _trace(
        _step(0, 0, 1000), _step(1, 1000, 1000),
        _op("IteratorGetNext", 0, 200),
        _op("MatMul", 200, 400, tid=2), _op("Conv2D", 300, 400, tid=3),
        _op("CollectiveReduceV2", 600, 300, tid=4),
        _op("IteratorGetNext", 1000, 500),
        _op("MatMul", 1400, 400, tid=2),
    )
    result = analyze_trace(trace, source="mem", top_k=2)
    assert result.steps == 2 and result.worker == "worker-0" and result.source == "mem"
    assert result.step_time_s == pytest.approx(0.001)
    assert result.computation_s == pytest.approx((500 + 400) / 2 / 1e6)
    assert result.communication_s == pytest.approx(200 / 2 / 1e6)  # exposed only
    assert result.communication_total_s == pytest.approx(300 / 2 / 1e6)
    assert result.input_s == pytest.approx((200 + 400) / 2 / 1e6)
    assert result.idle_s == pytest.approx((100 + 200) / 2 / 1e6)
    parts = result.computation_s + result.communication_s + result.input_s + result.idle_s
    assert parts == pytest.approx(result.step_time_s)
    assert result.bound == Bound.INPUT  # input is 30% of the step, communication 10%
    # The slowest ops by total: IteratorGetNext (200+500 µs), then MatMul (400+400 µs).
    assert [(s.op_name, s.count) for s in result.top_ops_by_total] == [("matmul", 2), ("iteratorgetnext", 2)]
    assert result.top_ops_by_total[0].total_s == pytest.approx(800e-6)
    assert result.top_ops_by_total[1].category == INPUT
    assert [s.op_name for s in result.top_ops_by_mean] == [("conv2d"), ("matmul")]
    assert result.top_ops_by_mean[0].mean_s == pytest.approx(400e-6)


def test_communication_bound_and_ops_outside_steps() -> None:
    trace = _trace(_step(5, 100, 100), _op("MatMul", 100, 20), _op("NcclAllReduce", 120, 60),
                   _op("MatMul", 5000, 100))  # after the last step: counted in top ops, not in steps
    result = analyze_trace(trace)
    assert result.steps == 1 and result.computation_s == pytest.approx(20e-6)
    assert result.communication_s == pytest.approx(60e-6) and result.idle_s == pytest.approx(20e-6)
    assert result.bound == Bound.COMMUNICATION
    assert result.top_ops_by_total[0].total_s == pytest.approx(120e-6)


def test_trace_without_step_events_is_one_window() -> None:
    result = analyze_trace(_trace(_op("MatMul", 10, 10), _op("MatMul", 30, 10)))
    assert result.steps == 1 and result.step_time_s == pytest.approx(30e-6)
    assert result.idle_s == pytest.approx(10e-6) and result.bound == Bound.COMPUTE
    assert analyze_trace(_trace()).steps == 0 and analyze_trace(_trace()).bound == Bound.UNSPECIFIED


def test_load_trace_reads_gzip_plain_and_bare_arrays_and_rejects_others(tmp_path) -> None:
    trace = _trace(_step(0, 0, 10), _step(1, 10, 30))
    path = tmp_path / "w.trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps(trace).encode()))
    assert load_trace(path) == trace
    assert load_trace(json.dumps(trace["traceEvents"]).encode())["traceEvents"] == trace["traceEvents"]
    assert trace_step_times(load_trace(path)) == pytest.approx([10e-6, 30e-6])
    with pytest.raises(ValueError, match="traceEvents"):
        load_trace(b'{"events": []}')
    with pytest.raises(ValueError, match="does not parse"):
        load_trace(b"not json")


def _record(step: int, duration: float, wait: float, examples: int = 32, kind: int = STEP_KIND_TRAIN) -> StepRecord:
    start = Timestamp()
    start.FromMicroseconds(1_700_000_000_000_000 + step * 1_000_000)
    return StepRecord(step=step, kind=kind, signature="keras.fit", start_time=start, duration_s=duration,
                      input_wait_s=wait, examples=examples)


def test_step_records_give_step_time_throughput_and_input_bound() -> None:
    records = [_record(0, 0.1, 0.05), _record(1, 0.2, 0.05), _record(2, 0.3, 0.05), _record(3, 0.4, 0.05),
               _record(0, 9.0, 0.0, kind=STEP_KIND_EVALUATE)]  # evaluation steps are left out
    result = analyze_steps(records)
    assert result.steps == 4 and result.step_time_s == pytest.approx(0.25)
    assert result.step_time_p50_s == pytest.approx(0.2) and result.step_time_p95_s == pytest.approx(0.4)
    assert result.input_s == pytest.approx(0.05) and result.examples_per_second == pytest.approx(128 / 1.0)
    assert result.bound == Bound.INPUT  # 0.05 / 0.25 = 20%
    assert analyze_steps([_record(0, 1.0, 0.1)]).bound == Bound.COMPUTE
    assert analyze_steps([]).steps == 0


def _aggregates(records: list[StepRecord]) -> list[SignatureStats]:
    """Per-signature aggregates of ``records``, as the service keeps them."""
    stats: dict[tuple[int, str], SignatureStats] = {}
    for r in records:
        s = stats.setdefault((r.kind, r.signature), SignatureStats(signature=r.signature, kind=r.kind))
        s.count, s.total_s, s.input_wait_s, s.examples = (s.count + 1, s.total_s + r.duration_s,
                                                          s.input_wait_s + r.input_wait_s, s.examples + r.examples)
    return list(stats.values())


@pytest.mark.parametrize("eval_kind", [STEP_KIND_EVALUATE, STEP_KIND_FUNCTION])
def test_signature_aggregates_give_what_the_steps_give(eval_kind: int) -> None:
    records = [_record(n, 0.1 * (n % 7 + 1), 0.01 * (n % 3), examples=16 + n % 2) for n in range(50)]
    records += [_record(n, 5.0, 0.0, kind=eval_kind) for n in range(5)]
    for chosen in (records, records[50:]):  # with training steps, and without any
        assert analyze_signatures(_aggregates(chosen), chosen) == analyze_steps(chosen)
    # A sample gives the percentiles only; the rest still covers every step.
    sampled = analyze_signatures(_aggregates(records), [r for r in records if r.step >= 45])
    assert sampled.steps == 50 and sampled.step_time_s == pytest.approx(analyze_steps(records).step_time_s)
    assert sampled.step_times_s == tuple(r.duration_s for r in records[45:50])  # the other kind is left out
    assert analyze_signatures([], []).steps == 0


def test_classify_and_percentile_edges() -> None:
    assert classify(0.0, input_s=0, communication_s=0) == Bound.UNSPECIFIED
    assert classify(1.0, input_s=0.3, communication_s=0.4) == Bound.COMMUNICATION
    assert classify(1.0, input_s=0.4, communication_s=0.4) == Bound.INPUT
    assert percentile([], 0.5) == 0.0 and percentile([3.0, 1.0, 2.0], 0.5) == 2.0
