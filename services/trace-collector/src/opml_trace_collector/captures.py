"""On-demand captures: arming the tracers, following each worker's answer, expiring the silent.

``arm`` writes the control key ``{redis_prefix}traces:capture:{job}`` = ``{"capture_id", "steps",
"workers"}`` with a TTL of ``capture_timeout_s``; the tracers of the job poll it, trace the next
``steps`` steps, upload ``s3://{bucket}/traces/{job}/{capture_id}/{worker}.trace.json.gz`` and only
then publish CaptureCompleted (or CaptureFailed). The service keeps its own record of the capture:

    PENDING --every targeted worker COMPLETED--> COMPLETED
            --every worker answered, one FAILED--> FAILED
            --capture_timeout_s passed, a worker silent--> EXPIRED

The tracers' answers are hints: one is applied only to a capture this service armed. ``arm`` also
records the capture in S3 (``TraceFiles.mark_armed``, ``captures/{job}/{capture_id}.armed``, outside
the ``traces/`` the tracers write), so an answer to a capture with no Redis record (the state was lost
and is being rebuilt from the topic) is applied only when that mark exists: an answer to a capture
nobody armed (forged, or made up by a tracer) raises :class:`UnknownCapture` and is dead-lettered.

A worker killed mid-capture never announces, so its capture expires: nothing half-written is ever
reported as complete. One capture per job may be pending at a time. Records change in optimistic
Redis transactions (WATCH), so the consumer, the expiry loop and the API never lose an update.

Captures are :class:`opml_trace_collector.model.Capture`; a record keeps each worker's answer as the
bytes of its ``opml.traces.v1.WorkerCapture`` message (:mod:`convert`), and its state as the enum's number.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Protocol

import redis.exceptions

from opml_common.bus import MalformedEvent
from opml_common.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from opml_common.metrics import ServiceMetrics
from opml_trace_collector.convert import decode_worker_capture, encode_worker_capture
from opml_trace_collector.model import Capture, CaptureFailed, CaptureState, RunState, TraceStored, WorkerCapture
from opml_trace_collector.store import Keys, TraceStore

log = logging.getLogger(__name__)

MAX_STEPS = 1000
_WORKER_FIELD = "worker\t"
_OUTCOME = {CaptureState.COMPLETED: "completed", CaptureState.FAILED: "failed", CaptureState.EXPIRED: "expired"}


class UnknownCapture(MalformedEvent):
    """A tracer answered a capture this service did not arm (no record in Redis, no mark in S3).

    Never retriable; the consumer dead-letters the event with this message, which names the capture.
    """


class ArmedMarks(Protocol):
    """Where ``arm`` durably records the captures it armed (``TraceFiles``; blocking, called in a thread)."""

    def mark_armed(self, job: str, capture_id: str, request: dict) -> None: ...

    def was_armed(self, job: str, capture_id: str) -> bool: ...


def trace_prefix(bucket: str, job: str, capture_id: str) -> str:
    """Where a capture's traces live: ``s3://{bucket}/traces/{job}/{capture_id}/``."""
    return f"s3://{bucket}/traces/{job}/{capture_id}/"


class _Record:
    """A capture record as read from its Redis hash."""

    def __init__(self, raw: dict[bytes, bytes]) -> None:
        self.raw = raw
        self.workers: dict[str, WorkerCapture] = {
            name.decode()[len(_WORKER_FIELD):]: decode_worker_capture(value)
            for name, value in raw.items() if name.startswith(_WORKER_FIELD.encode())}

    def __getitem__(self, name: str) -> str:
        return self.raw[name.encode()].decode()

    @property
    def state(self) -> CaptureState:
        return CaptureState(int(self["state"]))

    @property
    def targets(self) -> list[str]:
        return json.loads(self["targets"])

    @property
    def adopted(self) -> bool:
        """Created from a tracer's answer, the request unknown (see :meth:`CaptureManager._adopt`)."""
        return b"adopted" in self.raw

    def capture(self) -> Capture:
        targets = self.targets
        silent = CaptureState.EXPIRED if self.state == CaptureState.EXPIRED else CaptureState.PENDING
        workers = [self.workers.get(worker) or WorkerCapture(worker=worker, state=silent) for worker in targets]
        workers += [self.workers[w] for w in sorted(self.workers) if w not in targets]
        return Capture(capture_id=self["capture_id"], job=self["job"], steps=int(self["steps"]), state=self.state,
                       create_time=float(self["created"]), expire_time=float(self["expires"]),
                       end_time=float(self["ended"]) if b"ended" in self.raw else None, workers=tuple(workers),
                       requested_by=self["requested_by"])


class CaptureManager:
    """Arms captures, records the tracers' answers and expires silent captures.

    ``armed`` (the service passes its ``TraceFiles``) keeps a durable mark of each armed capture, so
    that the answers to captures armed before a loss of the Redis state are applied when the state is
    rebuilt; without it (None), only captures with a Redis record are answered.

    Metrics: ``opml_trace_collector_captures_total{outcome}`` (armed, completed, failed, expired).
    """

    def __init__(self, redis, keys: Keys, store: TraceStore, *, bucket: str, timeout_s: float,
                 metrics: ServiceMetrics, armed: ArmedMarks | None = None) -> None:
        self.redis = redis
        self.armed = armed
        self.keys = keys
        self.store = store
        self.bucket = bucket
        self.timeout_s = timeout_s
        self._captures = metrics.counter("captures_total", "Captures armed and how they ended, by outcome.",
                                         ("outcome",))

    # ---------------------------------------------------------------- the API side

    async def arm(self, job: str, steps: int, workers: Sequence[str], requested_by: str) -> Capture:
        """Arm a capture of the next ``steps`` steps of ``job``'s running workers (or ``workers``).

        Raises:
            InvalidArgument: ``steps`` is not in [1, 1000].
            NotFound: no tracer ever reported ``job``, or a named worker is not one of its workers.
            FailedPrecondition: no targeted worker is running, or another capture of the job is pending.
        """
        if not 1 <= steps <= MAX_STEPS:
            raise InvalidArgument("steps", f"must be in [1, {MAX_STEPS}], but got {steps}")
        await self.store.known_job(job)
        runs = await self.store.runs(job)
        known = {r.worker for r in runs}
        running = {r.worker for r in runs if r.state == RunState.RUNNING}
        for worker in workers:
            if worker not in known:
                raise NotFound(f"worker {worker!r} of job {job!r} is unknown")
            if worker not in running:
                raise FailedPrecondition(f"worker {worker!r} of job {job!r} is not running: only a live job "
                                         f"can be captured")
        targets = sorted(set(workers) or running)
        if not targets:
            raise FailedPrecondition(f"job {job!r} has no running worker to capture")
        capture_id = uuid.uuid4().hex[:16]
        active_key = self.keys.job_active_capture(job)
        while True:
            active = await self.redis.get(active_key)
            if active is not None:
                current = await self._load(active.decode())
                if current is not None and current.state == CaptureState.PENDING:
                    if float(current["expires"]) > time.time():
                        raise FailedPrecondition(
                            f"capture {current['capture_id']} of job {job!r} is still pending; wait until it "
                            f"completes or expires before requesting another")
                    await self.expire(current["capture_id"])
                    continue
            now = time.time()
            record = {"capture_id": capture_id, "job": job, "steps": steps, "state": int(CaptureState.PENDING),
                      "created": repr(now), "expires": repr(now + self.timeout_s), "requested_by": requested_by,
                      "targets": json.dumps(targets)}
            control = json.dumps({"capture_id": capture_id, "steps": steps, "workers": sorted(set(workers))})
            async with self.redis.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(active_key)
                    if await pipe.get(active_key) != active:
                        continue
                    pipe.multi()
                    pipe.hset(self.keys.capture(capture_id), mapping=record)
                    pipe.zadd(self.keys.job_captures(job), {capture_id: now})
                    pipe.zadd(self.keys.pending_captures, {capture_id: now + self.timeout_s})
                    pipe.set(active_key, capture_id)
                    pipe.set(self.keys.capture_control(job), control, px=int(self.timeout_s * 1000))
                    await pipe.execute()
                except redis.exceptions.WatchError:
                    continue
            break
        if self.armed is not None:
            try:
                await asyncio.to_thread(self.armed.mark_armed, job, capture_id, {
                    "capture_id": capture_id, "job": job, "steps": steps, "targets": targets,
                    "requested_by": requested_by, "created": now})
            except Exception as exc:  # noqa: BLE001 - the capture runs; only a rebuild would not know it
                log.warning("capture %s of job %s: could not record in S3 that it was armed (%s); its answers "
                            "will not be applied if the Redis state is lost before they come", capture_id, job, exc)
        self._captures.labels(outcome="armed").inc()
        log.info("capture %s of job %s armed: %d steps of %s", capture_id, job, steps, targets)
        return await self.get(capture_id)

    async def get(self, capture_id: str) -> Capture:
        """The capture (expired first when its time is up).

        Raises:
            NotFound: no such capture.
        """
        record = await self._load(capture_id)
        if record is None:
            raise NotFound(f"capture {capture_id!r} is unknown")
        if record.state == CaptureState.PENDING and float(record["expires"]) <= time.time():
            await self.expire(capture_id)
            record = await self._load(capture_id)
        return record.capture()

    async def ids(self, job: str) -> list[str]:
        """The ids of the job's captures, newest first (load a page of them with :meth:`get`)."""
        return [i.decode() for i in await self.redis.zrevrange(self.keys.job_captures(job), 0, -1)]

    async def latest_with_traces(self, job: str) -> Capture | None:
        """The newest capture of ``job`` with at least one completed trace, if any."""
        for capture_id in await self.ids(job):
            capture = await self.get(capture_id)
            if any(w.state == CaptureState.COMPLETED for w in capture.workers):
                return capture
        return None

    async def trace_url(self, capture_id: str, worker: str = "") -> str:
        """Where the trace of ``worker`` of a capture is (``worker`` may be empty when it has one trace).

        Raises:
            NotFound: no such capture, or it has no completed trace of ``worker``.
            FailedPrecondition: the capture has no completed trace yet.
            InvalidArgument: ``worker`` is empty but the capture has several traces (the field ``worker``).
        """
        capture = await self.get(capture_id)
        done = [w for w in capture.workers if w.state == CaptureState.COMPLETED]
        if worker:
            chosen = [w for w in done if w.worker == worker]
            if not chosen:
                raise NotFound(f"capture {capture.capture_id} has no completed trace of worker {worker!r} "
                               f"(completed: {[w.worker for w in done]})")
            return chosen[0].trace_url
        if not done:
            raise FailedPrecondition(f"capture {capture.capture_id} has no completed trace yet "
                                     f"(state CAPTURE_STATE_{capture.state.name})")
        if len(done) > 1:
            raise InvalidArgument("worker", f"is required: capture {capture.capture_id} has traces of "
                                            f"{[w.worker for w in done]}")
        return done[0].trace_url

    # ---------------------------------------------------------------- the tracers' answers

    async def on_completed(self, event: TraceStored, when: float) -> None:
        """Record a worker's stored trace, announced at ``when`` (idempotent).

        Raises:
            MalformedEvent: the trace URL is not under the capture's prefix in the service's bucket
                (the service never serves objects from elsewhere), or the capture is another job's.
            UnknownCapture: this service did not arm the capture.
            Unavailable: S3 could not say whether it armed a capture with no Redis record (retried).
        """
        prefix = trace_prefix(self.bucket, event.job, event.capture_id)
        if not event.trace_url.startswith(prefix) or ".." in event.trace_url:
            raise MalformedEvent(f"CaptureCompleted of capture {event.capture_id!r}: trace_url must be under "
                                 f"{prefix}, but got {event.trace_url!r}")
        await self._answer(event.job, event.capture_id, event.steps, when, WorkerCapture(
            worker=event.worker, state=CaptureState.COMPLETED, trace_url=event.trace_url,
            first_step=event.first_step, steps=event.steps, size_bytes=event.size_bytes,
            event_count=event.event_count))

    async def on_failed(self, event: CaptureFailed, when: float) -> None:
        """Record a worker's failure to capture, announced at ``when`` (idempotent).

        Raises:
            MalformedEvent: the capture is another job's.
            UnknownCapture: this service did not arm the capture.
            Unavailable: as :meth:`on_completed`.
        """
        await self._answer(event.job, event.capture_id, 0, when, WorkerCapture(
            worker=event.worker, state=CaptureState.FAILED, reason=event.reason))

    async def _answer(self, job: str, capture_id: str, steps: int, when: float, answer: WorkerCapture) -> None:
        if not await self.redis.exists(self.keys.capture(capture_id)):
            if not await self._was_armed(job, capture_id):
                raise UnknownCapture(f"capture {capture_id!r} of job {job!r} was not armed by this trace-collector "
                                     f"(no record of it); the answer of worker {answer.worker!r} was not applied")
            await self._adopt(job, capture_id, steps, when)

        def mutate(record: _Record) -> tuple[dict, CaptureState | None] | None:
            if record["job"] != job:
                raise MalformedEvent(f"capture {capture_id!r} belongs to job {record['job']!r}, not {job!r}")
            known = record.workers.get(answer.worker)
            if known is not None and known.state in (CaptureState.COMPLETED, CaptureState.FAILED):
                return None  # answered already: a repeat
            fields: dict = {_WORKER_FIELD + answer.worker: encode_worker_capture(answer)}
            workers = {**record.workers, answer.worker: answer}
            targets = record.targets
            if record.adopted:  # the request is unknown: its targets are the workers that answered
                targets = sorted({*targets, answer.worker})
                fields["targets"] = json.dumps(targets)
            elif record.state != CaptureState.PENDING:
                return fields, None  # resolved already: the answer is kept, the state stays
            states = [workers[w].state if w in workers else CaptureState.PENDING for w in targets]
            if CaptureState.PENDING in states:
                return fields, None
            outcome = CaptureState.FAILED if CaptureState.FAILED in states else CaptureState.COMPLETED
            fields["ended"] = repr(max(when, float(record["ended"])) if b"ended" in record.raw else when)
            return fields, (outcome if outcome != record.state else None)

        await self._update(capture_id, mutate)

    async def _was_armed(self, job: str, capture_id: str) -> bool:
        if self.armed is None:
            return False
        try:
            return await asyncio.to_thread(self.armed.was_armed, job, capture_id)
        except Exception as exc:
            raise Unavailable(f"cannot read from S3 whether capture {capture_id!r} of job {job!r} was armed: "
                              f"{exc}") from exc

    async def _adopt(self, job: str, capture_id: str, steps: int, when: float) -> None:
        """Create the record of a capture this service armed (its S3 mark says so) but has no Redis
        record of: its Redis keys were lost
        (the state is being rebuilt from the topic, or was lost while the capture ran). What the
        request was (who asked, which workers, when) is not in the events; the answers are."""
        log.warning("capture %s of job %s is unknown; recording it from the tracers' answers", capture_id, job)
        pipe = self.redis.pipeline(transaction=True)
        key = self.keys.capture(capture_id)
        for name, value in {"capture_id": capture_id, "job": job, "steps": steps, "state": int(CaptureState.PENDING),
                            "created": repr(when), "expires": repr(when), "requested_by": "",
                            "targets": "[]", "adopted": "1"}.items():
            pipe.hsetnx(key, name, value)
        pipe.zadd(self.keys.job_captures(job), {capture_id: when}, nx=True)
        await pipe.execute()

    # ---------------------------------------------------------------- expiry

    async def expire(self, capture_id: str) -> None:
        """Expire a pending capture whose time is up (no-op otherwise); it ended at its expiry time."""
        def mutate(record: _Record) -> tuple[dict, CaptureState | None] | None:
            if record.state != CaptureState.PENDING or record.adopted or float(record["expires"]) > time.time():
                return None
            return {"ended": record["expires"]}, CaptureState.EXPIRED

        await self._update(capture_id, mutate)

    async def expire_due(self) -> int:
        """Expire every pending capture whose time is up; returns how many were looked at."""
        due = await self.redis.zrangebyscore(self.keys.pending_captures, "-inf", time.time())
        for capture_id in due:
            await self.expire(capture_id.decode())
        return len(due)

    async def run_expiry(self, interval_s: float = 1.0) -> None:
        """Expire due captures every ``interval_s`` until cancelled (Redis hiccups are logged, not fatal)."""
        while True:
            try:
                await self.expire_due()
            except redis.exceptions.RedisError as exc:
                log.warning("capture expiry pass failed: %s", exc)
            await asyncio.sleep(interval_s)

    # ---------------------------------------------------------------- records

    async def _load(self, capture_id: str) -> _Record | None:
        raw = await self.redis.hgetall(self.keys.capture(capture_id))
        return _Record(raw) if raw else None

    async def _update(self, capture_id: str,
                      mutate: Callable[[_Record], tuple[dict, CaptureState | None] | None]) -> None:
        """Apply ``mutate``'s (fields, resolved state) to the record in a WATCH transaction; on a
        resolution also release the job's active capture and control key if they still name it.
        ``mutate`` returns None for no change, and puts ``ended`` in the fields of a resolution."""
        key = self.keys.capture(capture_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    raw = await pipe.hgetall(key)
                    if not raw:
                        await pipe.unwatch()
                        return
                    record = _Record(raw)
                    change = mutate(record)
                    if change is None:
                        await pipe.unwatch()
                        return
                    fields, resolved = change
                    job = record["job"]
                    control_key, active_key = self.keys.capture_control(job), self.keys.job_active_capture(job)
                    if resolved is not None:
                        await pipe.watch(control_key, active_key)
                        control = await pipe.get(control_key)
                        active = await pipe.get(active_key)
                    pipe.multi()
                    if resolved is not None:
                        fields = {**fields, "state": int(resolved)}  # the number, as always stored
                        pipe.zrem(self.keys.pending_captures, capture_id)
                        if active == capture_id.encode():
                            pipe.delete(active_key)
                        if control is not None and json.loads(control).get("capture_id") == capture_id:
                            pipe.delete(control_key)
                    if fields:
                        pipe.hset(key, mapping=fields)
                    await pipe.execute()
                    break
                except redis.exceptions.WatchError:
                    continue
        if resolved is not None:
            self._captures.labels(outcome=_OUTCOME[resolved]).inc()
            log.info("capture %s of job %s %s", capture_id, job, _OUTCOME[resolved])
