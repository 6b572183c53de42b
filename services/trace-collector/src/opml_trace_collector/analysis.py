"""The paper's analytics, pure: where the step time of a traced job goes.

Works on a Chrome trace (the service's captures and files offline alike) and on the always-on
step records. No I/O beyond :func:`load_trace`, no grpc, no Redis.

From a trace, each step window (``"cat": "step"`` events) is split into four parts that add up to
the step time exactly:

* computation: time any computation op runs;
* communication: time a communication op (collectives, RecvTensor, send/recv) runs while no
  computation does: the *exposed* communication that slows the step (``communication_total_s``
  keeps all of it, hidden or not);
* input: time an input-pipeline op (IteratorGetNext, tf.data dataset ops) runs while neither of
  the above does: the step waiting for its batch;
* idle: time no op runs (framework overhead, Python, host gaps).

Ops overlap (inter-op threads, devices), so each part is the length of a union of intervals,
never a sum of durations.

Bound classification (thresholds after the TensorFlow profiler's input-pipeline analyzer, which
calls a step "highly input bound" above 20%): INPUT when exposed input is at least
``BOUND_FRACTION`` (20%) of the step time, COMMUNICATION when exposed communication is, the larger
of the two when both are; COMPUTE otherwise; UNSPECIFIED with no steps. From the step records
alone (no op-level trace), input is the tracer's measured ``input_wait_s`` and communication is
unknown, so a job is INPUT or COMPUTE bound.

Percentiles are nearest-rank: p of n sorted values is the ceil(p*n)-th.
"""

from __future__ import annotations

import bisect
import enum
import gzip
import io
import json
import math
import re
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

BOUND_FRACTION = 0.20
DEFAULT_TOP_K = 10

COMPUTATION, COMMUNICATION, INPUT = "computation", "communication", "input"

# Op types that move tensors between devices or hosts (TF's rendezvous, collectives, NCCL, Horovod).
_COMMUNICATION_TYPES = frozenset({
    "AllReduce", "RecvTensor", "_Recv", "_Send", "_HostRecv", "_HostSend", "_RecvTensor", "Send", "Recv",
    "_MklSend", "_MklRecv",
})
_COMMUNICATION_PREFIXES = ("Collective", "Nccl", "Horovod", "XlaAllReduce", "AllGather", "AllToAll",
                           "ReduceScatter")
# Op types of the input pipeline: iterators and every tf.data dataset op (…Dataset, …DatasetV2…).
_INPUT_TYPES = frozenset({
    "IteratorGetNext", "IteratorGetNextSync", "IteratorGetNextAsOptional", "MultiDeviceIteratorGetNextFromShard",
    "MakeIterator", "IteratorV2", "AnonymousIterator", "AnonymousIteratorV2", "AnonymousIteratorV3",
    "DatasetToSingleElement", "OptionalGetValue", "OptionalHasValue",
})
_DATASET_TYPE = re.compile(r"Dataset(V\d+)?$")
_STEP_NAME = re.compile(r"^step (-?\d+)$")
_TRAIN = 1  # StepKind STEP_KIND_TRAIN (events.proto); this module imports no protos


class Bound(enum.IntEnum):
    """Values equal the proto enum ``opml.traces.v1.Bound``."""

    UNSPECIFIED = 0
    COMPUTE = 1
    INPUT = 2
    COMMUNICATION = 3


def op_category(op_type: str, op_name: str = "") -> str:
    """``"communication"``, ``"input"`` or ``"computation"`` for an op."""
    if op_type in _COMMUNICATION_TYPES or op_type.startswith(_COMMUNICATION_PREFIXES):
        return COMMUNICATION
    if op_type in _INPUT_TYPES or _DATASET_TYPE.search(op_type) or op_name.startswith("Iterator::"):
        return INPUT
    return COMPUTATION


@dataclass(frozen=True)
class OpStat:
    op_name: str
    op_type: str
    category: str
    count: int
    total_s: float
    mean_s: float


@dataclass(frozen=True)
class Breakdown:
    """Mean seconds per step of each part, and the slowest ops (see the module docstring)."""

    source: str
    steps: int
    step_time_s: float = 0.0
    step_time_p50_s: float = 0.0
    step_time_p95_s: float = 0.0
    computation_s: float = 0.0
    communication_s: float = 0.0
    input_s: float = 0.0
    idle_s: float = 0.0
    communication_total_s: float = 0.0
    examples_per_second: float = 0.0
    bound: Bound = Bound.UNSPECIFIED
    worker: str = ""
    step_times_s: tuple[float, ...] = ()
    top_ops_by_total: tuple[OpStat, ...] = field(default=())
    top_ops_by_mean: tuple[OpStat, ...] = field(default=())


# ---------------------------------------------------------------- interval sets

Intervals = list[tuple[float, float]]


def _merge(intervals: Iterable[tuple[float, float]]) -> Intervals:
    """Sorted, disjoint union of the intervals."""
    merged: Intervals = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def _intersect(a: Intervals, b: Intervals) -> Intervals:
    out: Intervals = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length_within(merged: Intervals, starts: list[float], lo: float, hi: float) -> float:
    """Length of ``merged`` inside [lo, hi]; ``starts`` are the intervals' starts (for bisect)."""
    total = 0.0
    index = max(bisect.bisect_right(starts, lo) - 1, 0)
    while index < len(merged) and merged[index][0] < hi:
        start, end = merged[index]
        total += max(0.0, min(end, hi) - max(start, lo))
        index += 1
    return total


class _Measure:
    def __init__(self, intervals: Intervals) -> None:
        self.intervals = intervals
        self.starts = [start for start, _ in intervals]

    def within(self, lo: float, hi: float) -> float:
        return _length_within(self.intervals, self.starts, lo, hi)


# ---------------------------------------------------------------- traces

class TraceTooBig(ValueError):
    """A trace over the size or event count its reader analyzes; the message names the cap."""


def load_trace(source: Path | bytes, *, max_bytes: int | None = None, max_events: int | None = None) -> dict:
    """A Chrome trace (gzip or plain JSON; an object with traceEvents, or a bare event array).

    ``max_bytes`` caps the JSON (decompressed as a stream: never more than the cap is held), and
    ``max_events`` the events; None: no cap (the CLI, on the user's own files).

    Raises:
        TraceTooBig: past a cap.
        ValueError: the content is not a Chrome trace.
    """
    data = source.read_bytes() if isinstance(source, Path) else source
    if data[:2] == b"\x1f\x8b":
        data = _gunzip(data, max_bytes)
    if max_bytes is not None and len(data) > max_bytes:
        raise TraceTooBig(f"the trace is over the {max_bytes} bytes analyzed here")
    try:
        trace = json.loads(data)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not a Chrome trace: the JSON does not parse ({exc})") from exc
    if isinstance(trace, list):
        trace = {"traceEvents": trace}
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError("not a Chrome trace: expected an object with a 'traceEvents' list")
    if max_events is not None and len(trace["traceEvents"]) > max_events:
        raise TraceTooBig(f"the trace has {len(trace['traceEvents'])} events, over the {max_events} events "
                          "analyzed here")
    return trace


def _gunzip(data: bytes, max_bytes: int | None) -> bytes:
    """``data`` decompressed, stopping one byte past ``max_bytes`` (a gzip bomb inflates no further)."""
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(data)) as stream:
            return stream.read(-1 if max_bytes is None else max_bytes + 1)
    except (OSError, EOFError, zlib.error) as exc:
        raise ValueError(f"not a Chrome trace: the gzip does not decompress ({exc})") from exc


def analyze_trace(trace: dict, *, source: str = "", top_k: int = DEFAULT_TOP_K) -> Breakdown:
    """The breakdown of one worker's Chrome trace (``ts``/``dur`` in microseconds).

    Step windows are the ``"cat": "step"`` complete events; a trace without any is one window from
    its first op to its last. Ops are the ``"cat": "op"`` complete events.
    """
    steps: Intervals = []
    ops: dict[str, Intervals] = {COMPUTATION: [], COMMUNICATION: [], INPUT: []}
    per_op: dict[tuple[str, str], list[float]] = {}
    for event in trace["traceEvents"]:
        if not isinstance(event, dict) or event.get("ph") != "X":
            continue
        try:
            start, duration = float(event["ts"]), float(event.get("dur", 0.0))
        except (KeyError, TypeError, ValueError):
            continue
        category = event.get("cat")
        if category == "step" and _STEP_NAME.match(str(event.get("name", ""))):
            steps.append((start, start + duration))
        elif category == "op":
            args = event.get("args") or {}
            op_type = str(args.get("op_type") or event.get("name", ""))
            op_name = str(args.get("op_name") or event.get("name", ""))
            ops[op_category(op_type, op_name)].append((start, start + duration))
            stats = per_op.setdefault((op_name, op_type), [0, 0.0])
            stats[0] += 1
            stats[1] += duration
    worker = str((trace.get("metadata") or {}).get("worker", ""))
    compute = _merge(ops[COMPUTATION])
    communication = _merge(ops[COMMUNICATION])
    inputs = _merge(ops[INPUT])
    if not steps:
        everything = _merge(ops[COMPUTATION] + ops[COMMUNICATION] + ops[INPUT])
        if not everything:
            return Breakdown(source=source, steps=0, worker=worker)
        steps = [(everything[0][0], everything[-1][1])]
    steps.sort()
    c = _Measure(compute)
    m = _Measure(communication)
    m_hidden = _Measure(_intersect(communication, compute))
    busy = _merge(compute + communication)
    i = _Measure(inputs)
    i_hidden = _Measure(_intersect(inputs, busy))
    a = _Measure(_merge(busy + inputs))
    totals = {"computation": 0.0, "communication": 0.0, "communication_total": 0.0, "input": 0.0, "idle": 0.0}
    step_times = []
    for lo, hi in steps:
        step_times.append((hi - lo) / 1e6)
        communication_all = m.within(lo, hi)
        totals["computation"] += c.within(lo, hi)
        totals["communication_total"] += communication_all
        totals["communication"] += communication_all - m_hidden.within(lo, hi)
        totals["input"] += i.within(lo, hi) - i_hidden.within(lo, hi)
        totals["idle"] += (hi - lo) - a.within(lo, hi)
    n = len(steps)
    mean = {key: value / n / 1e6 for key, value in totals.items()}
    step_time = sum(step_times) / n
    stats = [OpStat(op_name=name, op_type=kind, category=op_category(kind, name), count=int(count),
                    total_s=total / 1e6, mean_s=total / count / 1e6)
             for (name, kind), (count, total) in per_op.items()]
    return Breakdown(
        source=source, steps=n, worker=worker, step_time_s=step_time,
        step_time_p50_s=percentile(step_times, 0.50), step_time_p95_s=percentile(step_times, 0.95),
        computation_s=mean["computation"], communication_s=mean["communication"], input_s=mean["input"],
        idle_s=mean["idle"], communication_total_s=mean["communication_total"],
        bound=classify(step_time, input_s=mean["input"], communication_s=mean["communication"]),
        step_times_s=tuple(step_times),
        top_ops_by_total=tuple(sorted(stats, key=lambda s: (-s.total_s, s.op_name))[:top_k]),
        top_ops_by_mean=tuple(sorted(stats, key=lambda s: (-s.mean_s, s.op_name))[:top_k]),
    )


def trace_step_times(trace: dict) -> list[float]:
    """Durations (seconds) of the trace's steps in step order."""
    steps = []
    for event in trace["traceEvents"]:
        if isinstance(event, dict) and event.get("ph") == "X" and event.get("cat") == "step":
            match = _STEP_NAME.match(str(event.get("name", "")))
            if match:
                steps.append((int(match.group(1)), float(event.get("dur", 0.0)) / 1e6))
    return [duration for _, duration in sorted(steps)]


# ---------------------------------------------------------------- step records

def analyze_steps(records: Sequence, *, source: str = "metrics", worker: str = "") -> Breakdown:
    """The breakdown from the always-on step records (``StepRecord`` messages or look-alikes).

    Training steps are analyzed when there are any (evaluation and prediction steps would blur
    the step time); otherwise every step.
    """
    train = [r for r in records if r.kind == _TRAIN]
    chosen = train or list(records)
    durations = [r.duration_s for r in chosen]
    return _steps_breakdown(source, worker, steps=len(chosen), total_s=sum(durations),
                            input_s=sum(r.input_wait_s for r in chosen), examples=sum(r.examples for r in chosen),
                            durations=durations)


def analyze_signatures(signatures: Sequence, sample: Sequence, *, source: str = "metrics",
                       worker: str = "") -> Breakdown:
    """What :func:`analyze_steps` gives for every step, from per-signature aggregates instead.

    ``signatures`` (``SignatureStats`` or look-alikes: kind, count, total_s, input_wait_s,
    examples) cover every step, so the step count, means and throughput are exact however many
    steps there were; the percentiles come from ``sample``, a bounded set of step records (the
    steps of the chosen kinds only). Lets a service summarize a huge job without reading its steps.
    """
    counted = [s for s in signatures if s.count]
    train = [s for s in counted if s.kind == _TRAIN]
    chosen = train or counted
    durations = [r.duration_s for r in sample if r.kind == _TRAIN or not train]
    return _steps_breakdown(source, worker, steps=sum(s.count for s in chosen),
                            total_s=sum(s.total_s for s in chosen), input_s=sum(s.input_wait_s for s in chosen),
                            examples=sum(s.examples for s in chosen), durations=durations)


def _steps_breakdown(source: str, worker: str, *, steps: int, total_s: float, input_s: float, examples: int,
                     durations: Sequence[float]) -> Breakdown:
    if not steps:
        return Breakdown(source=source, steps=0, worker=worker)
    step_time = total_s / steps
    mean_input = input_s / steps
    return Breakdown(
        source=source, steps=steps, worker=worker, step_time_s=step_time,
        step_time_p50_s=percentile(durations, 0.50), step_time_p95_s=percentile(durations, 0.95),
        input_s=mean_input,
        examples_per_second=examples / total_s if total_s > 0 else 0.0,
        bound=classify(step_time, input_s=mean_input, communication_s=0.0),
        step_times_s=tuple(durations),
    )


def classify(step_time_s: float, *, input_s: float, communication_s: float) -> Bound:
    """The bound of a step (see the module docstring for the thresholds)."""
    if step_time_s <= 0:
        return Bound.UNSPECIFIED
    input_share, communication_share = input_s / step_time_s, communication_s / step_time_s
    if max(input_share, communication_share) < BOUND_FRACTION:
        return Bound.COMPUTE
    return Bound.INPUT if input_share >= communication_share else Bound.COMMUNICATION


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(math.ceil(p * len(ordered)) - 1, 0)]
