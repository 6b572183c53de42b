"""The tracer of one traced process: started by the post-import hook when the job imports TensorFlow.

On the job's thread it only patches TensorFlow (``patches``) and starts one background thread,
which reads the settings (``config``, standard library), then every ``poll_s`` reads the service's
control keys (``control``) and every ``flush_interval_s`` writes the steps recorded since the last
batch, with a host sample, to this run's spool folder (``spool``). The job never talks to the
broker: the host's shipper (``ship``) publishes the spool. At exit the last batch and
TracerStopped go to the spool, and the job waits at most ``exit_timeout_s`` for the shipper to
deliver them; what is not delivered by then is sent later. Anything failing in here is reported
once per kind on stderr and never reaches the job.
"""

from __future__ import annotations

import atexit
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
    from google.protobuf.message import Message

    from opml_trace_collector.inject.capture import Capture
    from opml_trace_collector.inject.config import TracerConfig
    from opml_trace_collector.inject.control import CaptureRequest, ControlPoller
    from opml_trace_collector.inject.spool import RunSpool

_tracer: Tracer | None = None
startup_cpu_s: float | None = None  # CPU of the job's thread in the import hook: this module's import, activate
_CAPTURE_EXIT_WAIT_S = 30.0  # a finished capture still uploading at exit gets this long
_SETUP_EXIT_WAIT_S = 10.0  # a job ending before the tracer's thread is set up waits this long for it
_EPOCH_BATCH_GAP_S = 0.1  # the least time between two batches (epochs of a fast fit share one)
_DELIVERY_CHECK_S = 0.005  # at exit, how often the job looks whether the shipper has taken its last events


def _timestamp(seconds: float):  # noqa: ANN202 - a protobuf Timestamp
    from google.protobuf.timestamp_pb2 import Timestamp
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def _quiet_libraries() -> None:
    """Keep our libraries' logs out of the job's output (the tracer warns once per kind itself)."""
    for name in ("opml_common", "urllib3", "minio", "redis"):
        logger = logging.getLogger(name)
        logger.propagate = False
        if not logger.handlers:
            logger.addHandler(logging.NullHandler())


class Tracer:
    """Built on the job's thread by ``activate``; ``settings``, ``spool`` and the rest exist once the
    tracer's thread set them up (``ready``)."""

    def __init__(self, tf_version: str) -> None:
        self.tf_version = tf_version
        self.session_id = uuid.uuid4().hex[:12]
        self.recorder = Recorder()
        self.patcher = Patcher(self.recorder)
        self.settings: TracerConfig | None = None
        self.spool: RunSpool | None = None
        self.poller: ControlPoller | None = None
        self.ready = threading.Event()  # the thread's set-up is over (``spool`` is None if it failed)
        self.exit_code = 0
        self.exit_s: float | None = None  # how long the job waited for the tracer at exit (set by stop)
        self.thread_cpu_s = 0.0  # the tracer's thread's CPU clock, read after each wake-up (the bench reads it)
        self._warned: set[str] = set()
        self._sequence = 0
        self._discarded = 0  # steps recorded before the first poll said tracing is off
        self._started_sent = False
        self._capture: Capture | None = None
        self._exports: set[threading.Thread] = set()
        self._outgoing: list[Message] = []  # events other threads hand the tracer's thread to write
        self._emit = threading.Lock()  # one writer of batches and events; ``_closed`` under it
        self._closed = False  # the last batch is written: nothing more goes to the spool
        self._wake = threading.Event()
        self._epoch_ended = False
        self._session = None
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
        """The tracer's thread: set up, then poll and batch until the job's exit."""
        try:
            ready = self._setup()
        except Exception as exc:  # noqa: BLE001 - never break the job: it runs untraced
            self.recorder.enabled = False
            self.recorder.drain()
            warn(f"the tracer failed to start ({exc!r}); the job runs untraced")
            ready = False
        self.ready.set()
        if ready:
            try:
                self._loop()
            except Exception as exc:  # noqa: BLE001
                self.warn_once("loop", f"the tracer's thread stopped ({exc!r}); the last batch is sent at exit")

    def _setup(self) -> bool:
        from opml_trace_collector.inject import config
        try:
            settings = config.read()
        except config.ConfigError as exc:
            self.recorder.enabled = False
            self.recorder.drain()
            warn(f"invalid tracer settings, the job runs untraced: {exc}")
            return False
        _quiet_libraries()
        import psutil

        from opml_trace_collector.inject.control import ControlPoller
        from opml_trace_collector.inject.spool import RunSpool
        from opml_trace_collector_contract.topics import TRACES, tracer_source
        self.settings = settings
        self._process = psutil.Process()
        self._process.cpu_percent(None)  # primes the counter: the first sample is then meaningful
        self.spool = RunSpool(settings.outlet / self.session_id, TRACES, tracer_source(settings.job, settings.worker),
                              settings.subject)
        safe = lambda text: text.replace("/", "_")  # noqa: E731
        self.session_file = settings.session_dir / safe(settings.job) / f"{safe(settings.worker)}.{self.session_id}.jsonl"
        try:
            self.session_file.parent.mkdir(parents=True, exist_ok=True)
            self._session = open(self.session_file, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        except OSError as exc:
            self.warn_once("session", f"cannot write the session file {self.session_file} ({exc})")
        self.poller = ControlPoller(settings.redis_url, settings.redis_prefix, settings.job, settings.worker,
                                    set_enabled=self._set_enabled, arm=self._arm, bad_request=self._bad_request,
                                    warn=self.warn_once)
        self.recorder.epoch_observer = self._on_epoch
        return True

    def _on_epoch(self) -> None:
        self._epoch_ended = True
        self._wake.set()

    def _loop(self) -> None:
        """Poll every ``poll_s``; write a batch every ``flush_interval_s`` and as soon as a Keras epoch
        ends (at most one per :data:`_EPOCH_BATCH_GAP_S`: epochs that end meanwhile share the next)."""
        s = self.settings
        now = time.monotonic()
        next_poll, next_batch, last_batch = now, now + s.flush_interval_s, now - _EPOCH_BATCH_GAP_S
        while not self._closed:
            now = time.monotonic()
            if now >= next_poll:
                self.poller.poll()
                next_poll = time.monotonic() + s.poll_s
            if self._outgoing:
                self._write(lambda: None)
            now = time.monotonic()
            epoch_due = self._epoch_ended and now >= last_batch + _EPOCH_BATCH_GAP_S
            if epoch_due or now >= next_batch:
                self._epoch_ended = False
                self._write(self._send_batch)
                last_batch, next_batch = now, now + s.flush_interval_s
            due = min(next_poll, next_batch, last_batch + _EPOCH_BATCH_GAP_S if self._epoch_ended else next_batch)
            self._wake.wait(max(0.0, due - time.monotonic()))
            self._wake.clear()
            self.thread_cpu_s = time.thread_time()

    def _write(self, then) -> None:  # noqa: ANN001 - a callable of no argument
        """Under the writer's lock, unless the last batch is written: the events handed over, then ``then``."""
        with self._emit:
            if self._closed:
                return
            outgoing, self._outgoing = self._outgoing, []
            for message in outgoing:
                self.spool.record(message)
            then()

    def _hand_over(self, message: Message) -> None:
        """From any thread: the tracer's thread writes ``message`` to the spool (no disk write here)."""
        self._outgoing.append(message)
        self._wake.set()

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
        """At exit: fail a capture still running, write the last batch and TracerStopped to the spool and
        give the shipper at most ``exit_timeout_s`` to deliver them; never longer, never raises."""
        began = time.perf_counter()
        try:
            if not self.ready.wait(_SETUP_EXIT_WAIT_S) or self.spool is None:
                return
            if self._capture is not None:
                self._capture.abandon("the job ended before the capture's steps ran")
            deadline = time.monotonic() + _CAPTURE_EXIT_WAIT_S
            for export in list(self._exports):
                export.join(max(0.0, deadline - time.monotonic()))
            bound = self.settings.exit_timeout_s
            # the first answer of the switch decides whether the steps so far are kept
            self.poller.first_poll.wait(bound / 2)
            from opml.traces.v1 import events_pb2 as pb
            with self._emit:
                self._closed = True
                for message in self._outgoing:
                    self.spool.record(message)
                self._outgoing = []
                self._send_batch(final=True)
                self.spool.record(pb.TracerStopped(job=self.settings.job, worker=self.settings.worker,
                                                   session_id=self.session_id,
                                                   steps=self.recorder.total - self._discarded,
                                                   exit_code=self.exit_code))
            self._wake.set()
            if self._session is not None:
                self._session.close()
            wait_from = time.perf_counter()
            deadline = time.monotonic() + bound
            while not (delivered := self.spool.drained()) and time.monotonic() < deadline:
                time.sleep(min(_DELIVERY_CHECK_S, max(0.0, deadline - time.monotonic())))
            self.spool.close()
            self.exit_s = time.perf_counter() - began
            if not delivered and bound > 0:
                self.warn_once("exit", f"the last events were not delivered within {bound:g} s (the job waited "
                               f"{self.exit_s:.3f} s at exit, {self.exit_s - (wait_from - began):.3f} s of them for "
                               f"the shipper); they wait in {self.spool.folder}, and the host's shipper sends them "
                               "(`python -m opml_trace_collector.inject.ship`)")
        except Exception:  # noqa: BLE001 - never delay or fail the job's exit beyond the bounds
            pass
        finally:
            if self.exit_s is None:
                self.exit_s = time.perf_counter() - began

    # --- batches ------------------------------------------------------------------------------

    def _send_batch(self, *, final: bool = False) -> None:
        """Write to the spool (TracerStarted first, then) the steps since the last batch; not before the
        switch's first answer, which may discard them, unless this is the last batch. Under ``_emit``."""
        from opml.traces.v1 import events_pb2 as pb
        if not self._started_sent:
            self._started_sent = True
            self.spool.record(pb.TracerStarted(
                job=self.settings.job, worker=self.settings.worker, session_id=self.session_id,
                tf_version=self.tf_version, patched=self.patcher.patched, pid=os.getpid(),
                hostname=socket.gethostname(), argv=sys.argv))
        if not final and not self.poller.first_poll.is_set():
            return
        steps = self.recorder.drain()
        epochs = self.recorder.drain_epochs()
        if not self.recorder.enabled:  # off: steps not sent yet are dropped (one may end after the switch's drain)
            self._discarded += len(steps)
            return
        memory = self._process.memory_info()
        host = pb.HostSample(time=_timestamp(time.time()), cpu_percent=self._process.cpu_percent(None),
                             rss_bytes=memory.rss)
        batch = pb.StepMetricsBatch(job=self.settings.job, worker=self.settings.worker,
                                    session_id=self.session_id, sequence=self._sequence, host=[host],
                                    epochs=[self._epoch(pb, e) for e in epochs])
        self.add_steps(batch.steps, steps)
        self._sequence += 1
        if self._session is not None and steps:
            from opml_trace_collector.session import step_to_line
            # one write: the file is line-buffered (a reader sees whole lines), and writelines would
            # make a system call per line
            self._session.write("".join([step_to_line(*step) + "\n" for step in steps]))
        self.spool.record(batch)

    @staticmethod
    def add_steps(records, steps: list[Step]) -> None:  # noqa: ANN001 - a batch's repeated StepRecord
        """Append a StepRecord per step to ``records`` in place: the same bytes as messages built apart
        (a Timestamp each) and handed to the batch, at a third of the CPU in a microbenchmark."""
        add = records.add
        for step in steps:
            record = add(step=step.step, kind=step.kind, signature=step.signature, duration_s=step.duration_s,
                         input_wait_s=step.input_wait_s, examples=step.examples)
            record.start_time.seconds, record.start_time.nanos = divmod(int(step.start_time * 1e9), 1_000_000_000)

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
        self._hand_over(pb.CaptureFailed(job=self.settings.job, worker=self.settings.worker, capture_id=capture_id,
                                         reason=reason))

    def _capture_stopped(self, capture: Capture) -> None:
        """In the job's thread: export the finished capture on a thread of its own, or announce its failure."""
        if capture.state != "done":
            capture.discard()
            self._announce_failure(capture.request.capture_id, capture.reason)
            return
        export = threading.Thread(target=self._export, args=(capture,), name="opml-tracer-capture", daemon=True)
        self._exports.add(export)
        export.start()

    def _export(self, capture: Capture) -> None:
        """Convert, upload, announce (a capture's thread); the platform's S3 settings are read here, by
        pydantic, so only a capture pays for them."""
        from opml.traces.v1 import events_pb2 as pb
        s = self.settings
        try:
            from opml_common.config import PlatformSettings
            from opml_common.storage import s3_client  # minio: ~0.2 s of imports, paid only by a capture
            from opml_trace_collector.inject import capture as capture_mod
            done = capture_mod.export(
                capture, job=s.job, worker=s.worker, tf_version=self.tf_version, bucket=s.bucket,
                max_events=s.max_trace_events, op_filter=s.op_filter,
                s3=s3_client(PlatformSettings(), max_connections=4),
                upload_retry_s=s.upload_retry_s, on_retry=lambda attempt, error, delay_s: warn(
                    f"uploading capture {capture.request.capture_id} failed (attempt {attempt}: "
                    f"{type(error).__name__}); retrying in {delay_s:.1f} s"))
        except Exception as exc:  # noqa: BLE001
            self._hand_over(pb.CaptureFailed(job=s.job, worker=s.worker, capture_id=capture.request.capture_id,
                                             reason=f"exporting the trace failed: {exc!r}"))
        else:
            self._hand_over(pb.CaptureCompleted(
                job=s.job, worker=s.worker, capture_id=capture.request.capture_id, first_step=done.first_step,
                steps=done.steps, trace_url=done.url, size_bytes=done.size_bytes, event_count=done.event_count))
        finally:
            capture.discard()
            self._exports.discard(threading.current_thread())


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
