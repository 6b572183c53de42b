"""On-demand op-level capture of a worker's next N steps with tf.profiler, without stopping the job.

The job's thread starts the profiler at the first step boundary after the capture is armed and
stops it after N more steps (``Capture.after_step``, the Recorder's observer). Converting the
XSpace to Chrome trace JSON and uploading it happen off the job's thread (``export``). The
announcement comes only after the S3 object is complete, so a worker killed mid-capture
announces nothing. While S3 cannot be reached the finished trace waits on the worker's disk and
the upload is retried (``upload``), for a bounded time that should end before the collector
expires the capture.
"""

from __future__ import annotations

import gzip
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from opml_trace_collector.inject.control import CaptureRequest
from opml_trace_collector.inject.recorder import Recorder, Step
from opml_trace_collector.inject.xspace import StepSpan, to_chrome

KIND_NAMES = {1: "train", 2: "evaluate", 3: "predict", 4: "session_run", 5: "function"}


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
           op_filter: str | None, s3, upload_retry_s: float = 0.0,  # noqa: ANN001 - a minio client
           on_retry: Callable[[int, Exception, float], None] | None = None) -> Exported:
    """Convert the capture's XSpace to gzip Chrome trace JSON and store it; blocking (run in a thread).

    Raises whatever reading, converting or uploading raised (S3 unreachable for longer than
    ``upload_retry_s``, see :func:`upload`); the caller announces the failure.
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
    upload(s3, bucket, key, path, retry_for_s=upload_retry_s, on_retry=on_retry)
    return Exported(f"s3://{bucket}/{key}", path.stat().st_size, len(trace["traceEvents"]), first, len(capture.spans))


UPLOAD_BACKOFF_S = (0.5, 10.0)  # first and longest wait between two upload attempts


def upload(s3, bucket: str, key: str, path: Path, *, retry_for_s: float,  # noqa: ANN001 - a minio client
           on_retry: Callable[[int, Exception, float], None] | None = None,
           sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> None:
    """Store ``path`` as ``s3://bucket/key`` in one PUT (S3 makes it visible whole or not at all).

    An attempt that cannot reach S3 (connection refused or reset, timeouts, 5xx: what minio raises
    once its own few quick retries are spent) is retried with capped backoff while the next attempt
    would still start within ``retry_for_s`` of the first; ``on_retry(attempt, error, delay_s)`` is
    told before each wait. S3's refusals (access denied, no such bucket policy...) are not retried.

    Raises:
        the last attempt's error, once the retry time is spent or S3 refused.
    """
    import urllib3
    from minio.error import ServerError

    from opml_common.retry import Backoff
    from opml_trace_collector.tracefiles import TraceFiles  # minio: imported by a capture only

    backoff = Backoff(base_s=UPLOAD_BACKOFF_S[0], max_s=UPLOAD_BACKOFF_S[1])
    deadline = clock() + retry_for_s
    attempt = 0
    while True:
        try:
            TraceFiles(s3, bucket).ensure_bucket()  # the service makes it at start; a tracer may run before that
            s3.fput_object(bucket, key, str(path), content_type="application/gzip")
            return
        except (urllib3.exceptions.HTTPError, OSError, ServerError) as error:
            delay = backoff.delay(attempt)
            attempt += 1
            if clock() + delay > deadline:
                raise
            if on_retry is not None:
                on_retry(attempt, error, delay)
            sleep(delay)
