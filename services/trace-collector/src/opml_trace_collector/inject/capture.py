"""On-demand op-level capture of a worker's next N steps with tf.profiler, without stopping the job.

The job's thread starts the profiler at the first step boundary after the capture is armed and
stops it after N more steps (``Capture.after_step``, the Recorder's observer). Converting the
XSpace to Chrome trace JSON and uploading it happen off the job's thread (``export``). The
announcement comes only after the S3 object is complete, so a worker killed mid-capture
announces nothing.
"""

from __future__ import annotations

import gzip
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from opml_trace_collector.inject.recorder import Recorder, Step
from opml_trace_collector.inject.xspace import StepSpan, to_chrome

KIND_NAMES = {1: "train", 2: "evaluate", 3: "predict", 4: "session_run", 5: "function"}


@dataclass(frozen=True)
class CaptureRequest:
    capture_id: str
    steps: int


@dataclass
class Capture:
    """One capture's life in the job's thread: armed -> active -> done | failed."""

    request: CaptureRequest
    recorder: Recorder
    on_stopped: Callable[[Capture], None]
    state: str = "armed"
    reason: str = ""
    logdir: Path | None = None
    spans: list[StepSpan] = field(default_factory=list)

    def after_step(self, step: Step) -> None:
        try:
            if self.state == "armed":
                from tensorflow.python.profiler import profiler_v2
                self.logdir = Path(tempfile.mkdtemp(prefix="opml-capture-"))
                profiler_v2.start(str(self.logdir))
                self.state = "active"
                return
            self.spans.append(StepSpan(step.step, KIND_NAMES.get(step.kind, "unspecified"), step.signature,
                                       int(step.start_time * 1e9), int(step.duration_s * 1e9)))
            if len(self.spans) >= self.request.steps:
                self._stop("done", "")
        except Exception as exc:  # noqa: BLE001 - a profiler problem fails the capture, never the job
            self._stop("failed", f"the profiler failed: {exc!r}")

    def abandon(self, reason: str) -> None:
        """The job is ending before the capture finished: fail it, announce no trace."""
        if self.state in ("armed", "active"):
            self._stop("failed", reason)

    def _stop(self, state: str, reason: str) -> None:
        if self.recorder.observer is self:
            self.recorder.observer = None
        if self.state == "active":
            try:
                from tensorflow.python.profiler import profiler_v2
                profiler_v2.stop()
            except Exception as exc:  # noqa: BLE001
                state, reason = "failed", reason or f"stopping the profiler failed: {exc!r}"
        self.state, self.reason = state, reason
        self.on_stopped(self)

    def discard(self) -> None:
        if self.logdir is not None:
            shutil.rmtree(self.logdir, ignore_errors=True)


@dataclass(frozen=True)
class Exported:
    url: str
    size_bytes: int
    event_count: int
    first_step: int
    steps: int


def export(capture: Capture, *, job: str, worker: str, tf_version: str, bucket: str, max_events: int,
           op_filter: str | None, s3) -> Exported:  # noqa: ANN001 - a minio client
    """Convert the capture's XSpace to gzip Chrome trace JSON and store it; blocking (run in a thread).

    Raises whatever reading, converting or uploading raised; the caller announces the failure.
    """
    try:
        from tensorflow.tsl.profiler.protobuf import xplane_pb2
    except ImportError:
        from tsl.profiler.protobuf import xplane_pb2
    assert capture.logdir is not None
    files = sorted(capture.logdir.rglob("*.xplane.pb"))
    if not files:
        raise RuntimeError("the profiler wrote no .xplane.pb file")
    space = xplane_pb2.XSpace()
    space.ParseFromString(files[-1].read_bytes())
    first = capture.spans[0].step if capture.spans else 0
    metadata = {"job": job, "worker": worker, "capture_id": capture.request.capture_id, "first_step": first,
                "steps": len(capture.spans), "tf_version": tf_version}
    trace, _ops = to_chrome(space, metadata=metadata, steps=capture.spans, max_events=max_events, op_filter=op_filter)
    path = capture.logdir / "trace.json.gz"
    with gzip.open(path, "wt", encoding="utf-8", compresslevel=6) as handle:
        json.dump(trace, handle, separators=(",", ":"))
    key = f"traces/{job}/{capture.request.capture_id}/{worker}.trace.json.gz"
    from opml_trace_collector.tracefiles import TraceFiles  # minio: imported by a capture only
    TraceFiles(s3, bucket).ensure_bucket()  # the service makes it at start; a tracer may run before that
    s3.fput_object(bucket, key, str(path), content_type="application/gzip")
    return Exported(f"s3://{bucket}/{key}", path.stat().st_size, len(trace["traceEvents"]), first, len(capture.spans))
