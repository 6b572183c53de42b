"""The tracer of one traced process: started by the post-import hook when the job imports TensorFlow.

It patches TensorFlow (``patches``), then every ``flush_interval_s`` sends the steps recorded
since the last batch with a host sample; it obeys the service's control keys and runs captures.
Anything failing in here is reported once per kind on stderr and never reaches the job.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import os
import socket
import sys
import threading
import time
import uuid
from types import ModuleType

import psutil
from google.protobuf.timestamp_pb2 import Timestamp
from opml.traces.v1 import events_pb2 as pb
from pydantic import ValidationError

from opml_common.config import PlatformSettings
from opml_common.storage import s3_client
from opml_trace_collector.inject import capture as capture_mod
from opml_trace_collector.inject.bootstrap import warn
from opml_trace_collector.inject.capture import Capture, CaptureRequest
from opml_trace_collector.inject.control import ControlPoller
from opml_trace_collector.inject.patches import Patcher
from opml_trace_collector.inject.recorder import Recorder, Step
from opml_trace_collector.inject.sender import Sender
from opml_trace_collector.inject.settings import TracerSettings

_tracer: Tracer | None = None
_CAPTURE_EXIT_WAIT_S = 30.0  # a finished capture still uploading at exit gets this long
_FIRST_POLL_WAIT_S = 1.0  # the job's start waits at most this long for the control keys' first answer


def _timestamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def _quiet_libraries() -> None:
    """Keep our libraries' logs out of the job's output (the tracer warns once per kind itself)."""
    for name in ("opml_common", "aiokafka", "urllib3", "minio", "redis"):
        logger = logging.getLogger(name)
        logger.propagate = False
        if not logger.handlers:
            logger.addHandler(logging.NullHandler())


class Tracer:
    def __init__(self, settings: TracerSettings, platform: PlatformSettings, tf_version: str) -> None:
        self.settings = settings
        self.platform = platform
        self.tf_version = tf_version
        self.session_id = uuid.uuid4().hex[:12]
        self.recorder = Recorder()
        self.patcher = Patcher(self.recorder)
        self.sender = Sender(settings, platform, self.session_id, self.warn_once)
        self.exit_code = 0
        self._warned: set[str] = set()
        self._sequence = 0
        self._started_sent = False
        self._capture: Capture | None = None
        self._exports: set[concurrent.futures.Future] = set()
        self._process = psutil.Process()
        self._lock = threading.Lock()

    def warn_once(self, kind: str, message: str) -> None:
        with self._lock:
            if kind in self._warned:
                return
            self._warned.add(kind)
        warn(message)

    # --- life cycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self.patcher.install()
        if not self.patcher.patched:
            warn(f"the tracer knows none of TensorFlow {self.tf_version}'s entry points; the job runs untraced")
            return
        self._process.cpu_percent(None)  # primes the counter: the first sample is then meaningful
        self.sender.start()
        self.sender.spawn(self._batches(), "sending step metrics")
        poller = ControlPoller(self.platform.redis_url, self.platform.redis_prefix, self.settings.job,
                               self.settings.worker, self.settings.poll_s, set_enabled=self._set_enabled,
                               arm=self._arm, bad_request=self._bad_request, warn=self.warn_once)
        self.sender.spawn(poller.run(), "polling the control keys")
        poller.first_poll.wait(_FIRST_POLL_WAIT_S)  # so a job started while tracing is off records nothing
        self._watch_exit()
        atexit.register(self.stop)

    def _watch_exit(self) -> None:
        """Learn the job's exit code for TracerStopped: sys.exit's argument, 1 for an uncaught error."""
        original_exit, original_hook = sys.exit, sys.excepthook

        def exit_(code=0):  # noqa: ANN001, ANN202 - sys.exit's signature
            self.exit_code = code if isinstance(code, int) else (0 if code is None else 1)
            original_exit(code)

        def excepthook(kind, value, tb):  # noqa: ANN001, ANN202
            self.exit_code = 1
            original_hook(kind, value, tb)

        sys.exit, sys.excepthook = exit_, excepthook

    def stop(self) -> None:
        """At exit: fail a capture still running, send the last batch and TracerStopped, briefly."""
        try:
            if self._capture is not None:
                self._capture.abandon("the job ended before the capture's steps ran")
            concurrent.futures.wait(list(self._exports), timeout=_CAPTURE_EXIT_WAIT_S)
            final = self.sender.submit(self._final())
            final.result(self.settings.exit_timeout_s + 1)
        except Exception:  # noqa: BLE001 - never delay or fail the job's exit beyond the timeouts
            pass
        self.sender.close(self.settings.exit_timeout_s)

    async def _final(self) -> None:
        await self._send_batch()
        await self.sender.emit(pb.TracerStopped(job=self.settings.job, worker=self.settings.worker,
                                                session_id=self.session_id, steps=self.recorder.total,
                                                exit_code=self.exit_code))

    # --- batches ------------------------------------------------------------------------------

    async def _batches(self) -> None:
        while True:
            await asyncio.sleep(self.settings.flush_interval_s)
            await self._send_batch()
            await self.sender.deliver()

    async def _send_batch(self) -> None:
        if not self._started_sent:
            self._started_sent = True
            await self.sender.emit(pb.TracerStarted(
                job=self.settings.job, worker=self.settings.worker, session_id=self.session_id,
                tf_version=self.tf_version, patched=self.patcher.patched, pid=os.getpid(),
                hostname=socket.gethostname(), argv=sys.argv))
        steps = self.recorder.drain()
        if not self.recorder.enabled and not steps:
            return
        memory = self._process.memory_info()
        host = pb.HostSample(time=_timestamp(time.time()), cpu_percent=self._process.cpu_percent(None),
                             rss_bytes=memory.rss)
        records = [self._record(s) for s in steps]
        batch = pb.StepMetricsBatch(job=self.settings.job, worker=self.settings.worker,
                                    session_id=self.session_id, sequence=self._sequence, steps=records, host=[host])
        self._sequence += 1
        self.sender.write_steps(records)
        await self.sender.emit(batch)

    @staticmethod
    def _record(step: Step) -> pb.StepRecord:
        return pb.StepRecord(step=step.step, kind=step.kind, signature=step.signature,
                             start_time=_timestamp(step.start_time), duration_s=step.duration_s,
                             input_wait_s=step.input_wait_s, examples=step.examples)

    # --- control ------------------------------------------------------------------------------

    def _set_enabled(self, enabled: bool) -> None:
        self.recorder.enabled = enabled

    def _arm(self, request: CaptureRequest) -> None:
        if self._capture is not None and self._capture.state in ("armed", "active"):
            self._announce_failure(request.capture_id, "another capture is running on this worker")
            return
        self._capture = Capture(request, self.recorder, self._capture_stopped)
        self.recorder.observer = self._capture

    def _bad_request(self, capture_id: str | None, reason: str) -> None:
        if capture_id:
            self._announce_failure(capture_id, reason)
        else:
            self.warn_once("bad-capture", f"ignoring a malformed capture request: {reason}")

    def _announce_failure(self, capture_id: str, reason: str) -> None:
        self.sender.spawn(self.sender.emit(pb.CaptureFailed(
            job=self.settings.job, worker=self.settings.worker, capture_id=capture_id, reason=reason)),
            "announcing a failed capture")

    def _capture_stopped(self, capture: Capture) -> None:
        """In the job's thread: hand the finished capture to the loop (export) or announce its failure."""
        if capture.state != "done":
            capture.discard()
            self._announce_failure(capture.request.capture_id, capture.reason)
            return
        future = self.sender.submit(self._export(capture))
        self._exports.add(future)
        future.add_done_callback(self._exports.discard)

    async def _export(self, capture: Capture) -> None:
        s = self.settings
        try:
            done = await asyncio.get_running_loop().run_in_executor(None, lambda: capture_mod.export(
                capture, job=s.job, worker=s.worker, tf_version=self.tf_version, bucket=s.bucket,
                max_events=s.max_trace_events, op_filter=s.op_filter, s3=s3_client(self.platform, max_connections=4)))
        except Exception as exc:  # noqa: BLE001
            await self.sender.emit(pb.CaptureFailed(job=s.job, worker=s.worker, capture_id=capture.request.capture_id,
                                                    reason=f"exporting the trace failed: {exc!r}"))
        else:
            await self.sender.emit(pb.CaptureCompleted(
                job=s.job, worker=s.worker, capture_id=capture.request.capture_id, first_step=done.first_step,
                steps=done.steps, trace_url=done.url, size_bytes=done.size_bytes, event_count=done.event_count))
        finally:
            capture.discard()


def activate(tensorflow: ModuleType) -> None:
    """Start tracing this process (once), unless TensorFlow's version or the settings rule it out."""
    global _tracer
    if _tracer is not None:
        return
    version = str(getattr(tensorflow, "__version__", "unknown"))
    if not version.startswith("2."):
        warn(f"TensorFlow {version} is not supported by the tracer (TensorFlow 2 only); the job runs untraced")
        return
    try:
        settings, platform = TracerSettings(), PlatformSettings()
    except ValidationError as exc:
        warn(f"invalid tracer settings, the job runs untraced: {exc}")
        return
    _quiet_libraries()
    _tracer = Tracer(settings, platform, version)
    _tracer.start()
