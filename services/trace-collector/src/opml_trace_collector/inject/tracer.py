"""The tracer of one traced process: started by the post-import hook when the job imports TensorFlow.

On the job's thread it only patches TensorFlow (``patches``) and starts one background thread;
everything else (the settings, the broker's and Redis's clients and their imports, about 0.35 s of
CPU) is loaded there while the job goes on. Every ``flush_interval_s`` that thread sends the steps
recorded since the last batch with a host sample; it obeys the service's control keys and runs
captures. At exit the job waits at most ``exit_timeout_s`` for the broker: the last batch is in the
spool before that wait starts, and what the broker has not acknowledged by then stays there for
``opml trace flush`` or the next traced run. Anything failing in here is reported once per kind on
stderr and never reaches the job.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import os
import socket
import sys
import threading
import time
import uuid
from types import ModuleType
from typing import TYPE_CHECKING

from opml_trace_collector.inject.bootstrap import warn
from opml_trace_collector.inject.patches import Patcher
from opml_trace_collector.inject.recorder import Epoch, Recorder, Step

if TYPE_CHECKING:  # imported on the tracer's thread, never on the job's
    from opml_common.config import PlatformSettings
    from opml_trace_collector.inject.capture import Capture, CaptureRequest
    from opml_trace_collector.inject.control import ControlPoller
    from opml_trace_collector.inject.sender import Sender
    from opml_trace_collector.inject.settings import TracerSettings

_tracer: Tracer | None = None
startup_cpu_s: float | None = None  # CPU of the job's thread in the import hook: this module's import, activate
_CAPTURE_EXIT_WAIT_S = 30.0  # a finished capture still uploading at exit gets this long
_SETUP_EXIT_WAIT_S = 10.0  # a job ending before the tracer's thread is set up waits this long for it
_WRITE_EXIT_WAIT_S = 2.0
_EPOCH_BATCH_GAP_S = 0.1  # the least time between two batches (epochs of a fast fit share one)  # at exit, the most the job waits for the last events to reach the spool


def _timestamp(seconds: float):  # noqa: ANN202 - a protobuf Timestamp
    from google.protobuf.timestamp_pb2 import Timestamp
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
    """Built on the job's thread by ``activate``; ``settings``, ``sender`` and the rest exist once the
    tracer's thread set them up (``ready``)."""

    def __init__(self, tf_version: str) -> None:
        self.tf_version = tf_version
        self.session_id = uuid.uuid4().hex[:12]
        self.recorder = Recorder()
        self.patcher = Patcher(self.recorder)
        self.settings: TracerSettings | None = None
        self.platform: PlatformSettings | None = None
        self.sender: Sender | None = None
        self.poller: ControlPoller | None = None
        self.ready = threading.Event()  # the thread's set-up is over (``sender`` is None if it failed)
        self.exit_code = 0
        self.exit_s: float | None = None  # how long the job waited for the tracer at exit (set by stop)
        self._warned: set[str] = set()
        self._sequence = 0
        self._discarded = 0  # steps recorded before the first poll said tracing is off
        self._started_sent = False
        self._capture: Capture | None = None
        self._exports: set[concurrent.futures.Future] = set()
        self._periodic: list[concurrent.futures.Future] = []  # the control poll and the batches
        self._process = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="opml-tracer", daemon=True)

    def warn_once(self, kind: str, message: str) -> None:
        with self._lock:
            if kind in self._warned:
                return
            self._warned.add(kind)
        warn(message)

    # --- life cycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """On the job's thread: patch, start the tracer's thread, hook the exit. Nothing slow."""
        self.patcher.install()
        if not self.patcher.patched:
            warn(f"the tracer knows none of TensorFlow {self.tf_version}'s entry points; the job runs untraced")
            return
        self._watch_exit()
        atexit.register(self.stop)
        self._thread.start()

    def _run(self) -> None:
        """The tracer's thread: load and set up everything, then run the sender's loop for good."""
        try:
            sender = self._setup()
        except Exception as exc:  # noqa: BLE001 - never break the job: it runs untraced
            self.recorder.enabled = False
            self.recorder.drain()
            warn(f"the tracer failed to start ({exc!r}); the job runs untraced")
            sender = None
        if sender is None:
            self.ready.set()
            return
        sender.run(on_ready=self._on_ready)

    def _setup(self) -> Sender | None:
        from pydantic import ValidationError

        from opml_common.config import PlatformSettings
        from opml_trace_collector.inject.settings import TracerSettings
        try:
            settings, platform = TracerSettings(), PlatformSettings()
        except ValidationError as exc:
            self.recorder.enabled = False
            self.recorder.drain()
            warn(f"invalid tracer settings, the job runs untraced: {exc}")
            return None
        _quiet_libraries()
        import psutil

        from opml_trace_collector.inject.control import ControlPoller
        from opml_trace_collector.inject.sender import Sender
        self.settings, self.platform = settings, platform
        self._process = psutil.Process()
        self._process.cpu_percent(None)  # primes the counter: the first sample is then meaningful
        self.sender = Sender(settings, platform, self.session_id, self.warn_once)
        self.poller = ControlPoller(platform.redis_url, platform.redis_prefix, settings.job, settings.worker,
                                    settings.poll_s, set_enabled=self._set_enabled, arm=self._arm,
                                    bad_request=self._bad_request, warn=self.warn_once)
        return self.sender

    def _on_ready(self) -> None:
        """On the loop, once the sender is set up: start the batches and the control poll."""
        self._periodic = [self.sender.spawn(self.poller.run(), "polling the control keys"),
                          self.sender.spawn(self._batches(), "sending step metrics")]
        self.ready.set()

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
        """At exit: fail a capture still running, put the last batch and TracerStopped in the spool and
        give the broker at most ``exit_timeout_s`` to acknowledge them; never longer, never raises."""
        began = time.perf_counter()
        try:
            if not self.ready.wait(_SETUP_EXIT_WAIT_S) or self.sender is None:
                return
            if self._capture is not None:
                self._capture.abandon("the job ended before the capture's steps ran")
            if self._exports:
                concurrent.futures.wait(list(self._exports), timeout=_CAPTURE_EXIT_WAIT_S)
            bound = self.settings.exit_timeout_s
            written = threading.Event()
            final = self.sender.submit(self._final(written, bound))
            written.wait(_WRITE_EXIT_WAIT_S)
            wait_from = time.perf_counter()
            try:
                delivered = final.result(bound)
            except Exception:  # noqa: BLE001 - a timeout: what was not sent stays in the spool
                delivered = False
            self.exit_s = time.perf_counter() - began
            if not delivered:
                self.warn_once("exit", f"the broker did not acknowledge the last events within {bound:g} s "
                               f"(the job waited {self.exit_s:.3f} s at exit, {self.exit_s - (wait_from - began):.3f} s "
                               f"of them for the broker); they wait in {self.sender.spool_folder} for "
                               "`opml trace flush` or the next traced run")
        except Exception:  # noqa: BLE001 - never delay or fail the job's exit beyond the bounds
            pass
        finally:
            if self.exit_s is None:
                self.exit_s = time.perf_counter() - began

    async def _final(self, written: threading.Event, bound: float) -> bool:
        """On the loop: record the last events durably, then deliver and close within ``bound``."""
        poll, batches = self._periodic
        batches.cancel()  # a batch in flight (or stuck on the broker) ends here: the last one follows
        try:
            if not self.poller.answered.is_set():
                try:  # the first answer of the switch decides whether the steps so far are kept
                    await asyncio.wait_for(self.poller.answered.wait(), bound / 2)
                except TimeoutError:
                    pass
            poll.cancel()
            await self._send_batch(final=True)
            from opml.traces.v1 import events_pb2 as pb
            self.sender.record(pb.TracerStopped(job=self.settings.job, worker=self.settings.worker,
                                                session_id=self.session_id,
                                                steps=self.recorder.total - self._discarded,
                                                exit_code=self.exit_code))
        finally:
            written.set()
        try:
            return await asyncio.wait_for(self.sender.finish(), bound)
        except (TimeoutError, Exception):  # noqa: BLE001
            return False

    # --- batches ------------------------------------------------------------------------------

    async def _batches(self) -> None:
        """A batch every ``flush_interval_s``, and as soon as a Keras epoch ends (at most one per
        :data:`_EPOCH_BATCH_GAP_S`: epochs that end meanwhile share the next batch)."""
        loop = asyncio.get_running_loop()
        epoch_ended = asyncio.Event()
        self.recorder.epoch_observer = lambda: loop.call_soon_threadsafe(epoch_ended.set)
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(epoch_ended.wait(), self.settings.flush_interval_s)
            epoch_ended.clear()
            await self._send_batch()
            await self.sender.deliver()
            await asyncio.sleep(_EPOCH_BATCH_GAP_S)

    async def _send_batch(self, *, final: bool = False) -> None:
        """Record in the spool (TracerStarted first, then) the steps since the last batch; not before the
        switch's first answer, which may discard them, unless this is the last batch."""
        from opml.traces.v1 import events_pb2 as pb
        if not self._started_sent:
            self._started_sent = True
            self.sender.record(pb.TracerStarted(
                job=self.settings.job, worker=self.settings.worker, session_id=self.session_id,
                tf_version=self.tf_version, patched=self.patcher.patched, pid=os.getpid(),
                hostname=socket.gethostname(), argv=sys.argv))
        if not final and not self.poller.answered.is_set():
            return
        steps = self.recorder.drain()
        epochs = self.recorder.drain_epochs()
        if not self.recorder.enabled:  # off: steps not sent yet are dropped (one may end after the switch's drain)
            self._discarded += len(steps)
            return
        memory = self._process.memory_info()
        host = pb.HostSample(time=_timestamp(time.time()), cpu_percent=self._process.cpu_percent(None),
                             rss_bytes=memory.rss)
        records = [self._record(pb, s) for s in steps]
        batch = pb.StepMetricsBatch(job=self.settings.job, worker=self.settings.worker,
                                    session_id=self.session_id, sequence=self._sequence, steps=records, host=[host],
                                    epochs=[self._epoch(pb, e) for e in epochs])
        self._sequence += 1
        self.sender.write_steps(records)
        self.sender.record(batch)

    @staticmethod
    def _record(pb: ModuleType, step: Step):  # noqa: ANN205 - a StepRecord
        return pb.StepRecord(step=step.step, kind=step.kind, signature=step.signature,
                             start_time=_timestamp(step.start_time), duration_s=step.duration_s,
                             input_wait_s=step.input_wait_s, examples=step.examples)

    @staticmethod
    def _epoch(pb: ModuleType, epoch: Epoch):  # noqa: ANN205 - an EpochLog
        logs = {}
        for name, value in epoch.logs.items():
            try:
                logs[str(name)] = float(value)
            except (TypeError, ValueError):  # a value that is no number (Keras passes only numbers)
                continue
        return pb.EpochLog(epoch=epoch.epoch, fit=epoch.fit, time=_timestamp(epoch.time), logs=logs)

    # --- control ------------------------------------------------------------------------------

    def _set_enabled(self, enabled: bool) -> None:
        """The switch's answer (the loop's thread). Off: steps recorded meanwhile (before the first
        answer, the job did not wait for it) are dropped, and not counted in TracerStopped."""
        self.recorder.enabled = enabled
        if not enabled:
            self._discarded += len(self.recorder.drain())
            self.recorder.drain_epochs()

    def _arm(self, request: CaptureRequest) -> None:
        from opml_trace_collector.inject.capture import Capture
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
        from opml.traces.v1 import events_pb2 as pb
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
        from opml.traces.v1 import events_pb2 as pb

        from opml_common.storage import s3_client  # minio: ~0.2 s of imports, paid only by a capture
        from opml_trace_collector.inject import capture as capture_mod
        s = self.settings
        try:
            done = await asyncio.get_running_loop().run_in_executor(None, lambda: capture_mod.export(
                capture, job=s.job, worker=s.worker, tf_version=self.tf_version, bucket=s.bucket,
                max_events=s.max_trace_events, op_filter=s.op_filter, s3=s3_client(self.platform, max_connections=4),
                upload_retry_s=s.upload_retry_s, on_retry=lambda attempt, error, delay_s: warn(
                    f"uploading capture {capture.request.capture_id} failed (attempt {attempt}: "
                    f"{type(error).__name__}); retrying in {delay_s:.1f} s")))
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
    """Start tracing this process (once), unless TensorFlow's version rules it out. On the job's thread:
    only the patches; the settings are read on the tracer's thread (invalid: a warning, untraced)."""
    global _tracer
    if _tracer is not None:
        return
    version = str(getattr(tensorflow, "__version__", "unknown"))
    if not version.startswith("2."):
        warn(f"TensorFlow {version} is not supported by the tracer (TensorFlow 2 only); the job runs untraced")
        return
    _tracer = Tracer(version)
    _tracer.start()
