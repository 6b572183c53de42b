"""Jobs' durable state in Redis, so a restarted orchestrator knows every job and where it stood.

Two keys under the platform's ``redis_prefix``: ``{prefix}job-orchestrator:jobs``, a hash of job
id to the serialized ``opml.jobs.v1.Job`` (spec and status), and ``{prefix}job-orchestrator:order``,
a sorted set of job ids by submission sequence, so :meth:`JobStore.load` returns jobs in the
order they were submitted (the order a restart queues them again in); and
``{prefix}job-orchestrator:submitters``, a hash of job id to the name of the principal who
submitted it (who may read its logs and cancel it besides admins; not in ``opml.jobs.v1.Job``).

The orchestrator's lifecycle listeners must not block its loop: :meth:`JobStore.save` only
queues the snapshot, and one writer task writes snapshots in order, retrying (with backoff) while
Redis is away. A request that changes a job (submit, cancel, preempt) awaits :meth:`JobStore.flushed`
before it answers, so what a caller was told survives a crash. :meth:`JobStore.stop` writes what
is still queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from opml.jobs.v1 import jobs_pb2 as pb
from redis.exceptions import RedisError

from opml_common.errors import DataLoss
from opml_common.lifecycle import Component, cancel_and_wait
from opml_common.retry import Backoff

logger = logging.getLogger(__name__)

_BACKOFF = Backoff(base_s=0.1, max_s=5.0)


class JobStore(Component):
    """Job snapshots in Redis. ``redis`` is an asyncio client (``opml_common.storage.redis_client``).

    Long-lived: ``start()`` begins the writer task, ``stop()`` drains the queue and ends it; both
    idempotent. ``load()`` may be called before ``start()``.
    """

    def __init__(self, redis: Any, *, prefix: str) -> None:
        super().__init__()
        self._redis = redis
        self._jobs_key = f"{prefix}job-orchestrator:jobs"
        self._order_key = f"{prefix}job-orchestrator:order"
        self._seq_key = f"{prefix}job-orchestrator:seq"
        self._submitters_key = f"{prefix}job-orchestrator:submitters"
        self._queue: asyncio.Queue[tuple[pb.Job, str | None]] = asyncio.Queue()
        self._writer: asyncio.Task[None] | None = None

    async def load(self) -> list[pb.Job]:
        """Every job saved, in submission order.

        Raises:
            redis.exceptions.RedisError: Redis cannot be reached (the service does not start).
            DataLoss: a saved job does not parse.
        """
        ids = await self._redis.zrange(self._order_key, 0, -1)
        if not ids:
            return []
        jobs = []
        for job_id, data in zip(ids, await self._redis.hmget(self._jobs_key, ids), strict=True):
            if data is None:
                continue  # ordered before its first snapshot was written: the submit never completed
            job = pb.Job()
            try:
                job.ParseFromString(data)
            except Exception as exc:  # noqa: BLE001 - protobuf raises DecodeError and others
                raise DataLoss(f"saved job {job_id!r} under {self._jobs_key} does not parse: {exc}") from exc
            jobs.append(job)
        return jobs

    async def load_submitters(self) -> dict[str, str]:
        """Job id -> the name of the principal who submitted it, for every job saved with one.

        Raises:
            redis.exceptions.RedisError: Redis cannot be reached.
        """
        found = await self._redis.hgetall(self._submitters_key)
        return {_text(k): _text(v) for k, v in found.items()}

    def save(self, job: pb.Job, *, submitter: str | None = None) -> None:
        """Queue a snapshot of ``job`` to write (with ``submitter``, its submitter's name too); never
        blocks (called from the orchestrator's listeners)."""
        self._queue.put_nowait((job, submitter))

    async def flushed(self) -> None:
        """Return once every snapshot queued so far is written (waits while Redis is away)."""
        await self._queue.join()

    async def on_start(self) -> None:
        self._writer = asyncio.create_task(self._write_loop(), name="job-store-writer")

    async def on_stop(self) -> None:
        """Write what is queued (while Redis answers), then end the writer task."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._queue.join(), timeout=10)
        writer, self._writer = self._writer, None
        await cancel_and_wait(writer)

    async def _write_loop(self) -> None:
        while True:
            job, submitter = await self._queue.get()
            failures = 0
            while True:
                try:
                    await self._write(job, submitter)
                    break
                except RedisError as exc:
                    logger.warning("job store: write failed, will retry", extra={"job": job.status.job_id,
                                                                                 "error": str(exc)})
                    await asyncio.sleep(_BACKOFF.delay(failures))
                    failures += 1
            self._queue.task_done()

    async def _write(self, job: pb.Job, submitter: str | None) -> None:
        job_id = job.status.job_id
        if submitter is not None:  # before the job: a job is never loaded without its submitter
            await self._redis.hset(self._submitters_key, job_id, submitter)
        if not await self._redis.zscore(self._order_key, job_id):
            seq = await self._redis.incr(self._seq_key)
            await self._redis.zadd(self._order_key, {job_id: seq}, nx=True)
        await self._redis.hset(self._jobs_key, job_id, job.SerializeToString())


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
