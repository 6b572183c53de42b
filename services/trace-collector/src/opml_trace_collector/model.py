"""The trace-collector's domain types: what the core (:mod:`store`, :mod:`captures`, :mod:`summary`,
:mod:`aggregator`) takes and returns. No protobuf here; :mod:`opml_trace_collector.convert` maps them
to and from the opml.traces.v1 messages (the API's and the tracer's events).

Times are epoch seconds (floats), except a step's start, kept in epoch nanoseconds as the tracer
measures it so a step record goes through the service unchanged. Enum values equal those of the
protos (``StepKind``, ``RunState``, ``CaptureState``; ``analysis.Bound``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from opml_trace_collector.analysis import Breakdown


class StepKind(enum.IntEnum):
    """``opml.traces.v1.StepKind``."""

    UNSPECIFIED = 0
    TRAIN = 1
    EVALUATE = 2
    PREDICT = 3
    SESSION_RUN = 4
    FUNCTION = 5


class RunState(enum.IntEnum):
    """``opml.traces.v1.RunState``."""

    UNSPECIFIED = 0
    RUNNING = 1
    STOPPED = 2
    LOST = 3


class CaptureState(enum.IntEnum):
    """``opml.traces.v1.CaptureState``."""

    UNSPECIFIED = 0
    PENDING = 1
    COMPLETED = 2
    FAILED = 3
    EXPIRED = 4


# ---------------------------------------------------------------- the tracers' events

@dataclass(frozen=True)
class StepRecord:
    """One step of one worker, as the tracer measured it."""

    step: int
    kind: int  # a StepKind value (an unknown one is kept as is)
    signature: str
    start_ns: int  # epoch nanoseconds
    duration_s: float
    input_wait_s: float = 0.0
    examples: int = 0

    @property
    def start_us(self) -> int:
        """The start in epoch microseconds (the series' order)."""
        return self.start_ns // 1000


@dataclass(frozen=True)
class HostSample:
    time_s: float
    cpu_percent: float
    rss_bytes: int


@dataclass(frozen=True)
class TracerStarted:
    job: str
    worker: str
    session_id: str
    tf_version: str = ""
    patched: tuple[str, ...] = ()
    pid: int = 0
    hostname: str = ""
    argv: tuple[str, ...] = ()


@dataclass(frozen=True)
class StepBatch:
    """A StepMetricsBatch: the steps of one flush of one run, numbered by ``sequence``."""

    job: str
    worker: str
    session_id: str
    sequence: int
    steps: tuple[StepRecord, ...] = ()
    host: tuple[HostSample, ...] = ()


@dataclass(frozen=True)
class TracerStopped:
    job: str
    worker: str
    session_id: str
    steps: int = 0
    exit_code: int = 0


@dataclass(frozen=True)
class TraceStored:
    """A CaptureCompleted: one worker's trace of a capture is in S3 at ``trace_url``."""

    job: str
    worker: str
    capture_id: str
    trace_url: str
    first_step: int = 0
    steps: int = 0
    size_bytes: int = 0
    event_count: int = 0


@dataclass(frozen=True)
class CaptureFailed:
    job: str
    worker: str
    capture_id: str
    reason: str = ""


TracerEvent = TracerStarted | StepBatch | TracerStopped | TraceStored | CaptureFailed


# ---------------------------------------------------------------- the state the API reads

@dataclass(frozen=True)
class SignatureStats:
    signature: str
    kind: int
    count: int
    total_s: float
    mean_s: float
    min_s: float
    max_s: float
    input_wait_s: float
    examples: int


@dataclass(frozen=True)
class Run:
    job: str
    worker: str
    session_id: str
    state: RunState
    started: float
    last_seen: float
    stopped: float | None = None  # None while not stopped
    tf_version: str = ""
    patched: tuple[str, ...] = ()
    pid: int = 0
    hostname: str = ""
    argv: tuple[str, ...] = ()
    exit_code: int = 0
    steps: int = 0
    batches: int = 0
    missing_batches: int = 0
    signatures: tuple[SignatureStats, ...] = ()
    examples_per_second: float = 0.0
    cpu_percent: float = 0.0
    rss_bytes: int = 0


@dataclass(frozen=True)
class Job:
    job: str
    run_count: int
    running_runs: int
    steps: int
    first_seen: float
    last_seen: float
    mean_step_s: float
    examples_per_second: float


@dataclass(frozen=True)
class StepPoint:
    """A step record of the series, with the run it belongs to."""

    worker: str
    session_id: str
    record: StepRecord


@dataclass(frozen=True)
class WorkerCapture:
    worker: str
    state: CaptureState
    trace_url: str = ""
    first_step: int = 0
    steps: int = 0
    size_bytes: int = 0
    event_count: int = 0
    reason: str = ""


@dataclass(frozen=True)
class Capture:
    capture_id: str
    job: str
    steps: int
    state: CaptureState
    create_time: float
    expire_time: float
    end_time: float | None = None  # None while pending
    workers: tuple[WorkerCapture, ...] = ()  # the targeted workers, then any other that answered
    requested_by: str = ""


@dataclass(frozen=True)
class Summary:
    """GetSummary's answer: the step-metrics breakdown and one breakdown per worker's trace."""

    job: str
    metrics: Breakdown
    capture_id: str = ""  # the capture the traces come from ('' when none)
    traces: tuple[Breakdown, ...] = ()
