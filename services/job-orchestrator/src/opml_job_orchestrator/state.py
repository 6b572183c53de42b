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

Several replicas share these keys; only the one holding the ``job-orchestrator`` lease writes them.
Its writes are fenced: one Lua script checks the lease's fence (:class:`~opml_common.lease.Fence`)
and writes the snapshot in the same step, so a deposed leader's late snapshot (it stalled past its
lease, then woke) is refused, logged and dropped, never applied over its successor's. Every
replica reads them (:meth:`JobStore.job`, :meth:`JobStore.load`) to serve the API.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from opml.jobs.v1 import jobs_pb2 as pb
from redis.exceptions import RedisError

from opml_common.errors import DataLoss, NotFound
from opml_common.lease import Fence, NotLeader
from opml_common.lifecycle import Component, cancel_and_wait
from opml_common.retry import Backoff

logger = logging.getLogger(__name__)

_BACKOFF = Backoff(base_s=0.1, max_s=5.0)

# KEYS: jobs hash, order zset, seq, submitters hash, fence (or any key when unfenced).
# ARGV: job id, snapshot, submitter ('' none), fence token ('' unfenced).
_WRITE = """
if ARGV[4] ~= '' and redis.call('GET', KEYS[5]) ~= ARGV[4] then return 0 end
if ARGV[3] ~= '' then redis.call('HSET', KEYS[4], ARGV[1], ARGV[3]) end
if not redis.call('ZSCORE', KEYS[2], ARGV[1]) then
  redis.call('ZADD', KEYS[2], 'NX', redis.call('INCR', KEYS[3]), ARGV[1])
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""


class JobStore(Component):
    """Job snapshots in Redis. ``redis`` is an asyncio client (``opml_common.storage.redis_client``).

    Long-lived: ``start()`` begins the writer task, ``stop()`` drains the queue and ends it; both
    idempotent. ``load()`` may be called before ``start()``. ``fence`` gives the leader's current
    fence (raising NotLeader when this replica does not lead); None: one writer by construction.
    """

    def __init__(self, redis: Any, *, prefix: str, fence: Callable[[], Fence] | None = None) -> None:
        super().__init__()
        self._redis = redis
        self._jobs_key = f"{prefix}job-orchestrator:jobs"
        self._order_key = f"{prefix}job-orchestrator:order"
        self._seq_key = f"{prefix}job-orchestrator:seq"
        self._submitters_key = f"{prefix}job-orchestrator:submitters"
        self._queue: asyncio.Queue[tuple[pb.Job, str | None]] = asyncio.Queue()
        self._writer: asyncio.Task[None] | None = None
        self._fence = fence
        self._write_script = redis.register_script(_WRITE)
        self.refused = 0
        """Snapshots refused because the lease had moved on (a deposed leader's late writes)."""

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

    async def job(self, job_id: str) -> tuple[pb.Job, str | None]:
        """One job as saved and its submitter's name (a follower's reads).

        Raises:
            NotFound: no job of that id is saved.
            DataLoss: it does not parse.
        """
        data, submitter = await asyncio.gather(self._redis.hget(self._jobs_key, job_id),
                                               self._redis.hget(self._submitters_key, job_id))
        if data is None:
            raise NotFound(f"job {job_id!r} was never submitted.")
        job = pb.Job()
        try:
            job.ParseFromString(data)
        except Exception as exc:  # noqa: BLE001 - protobuf raises DecodeError and others
            raise DataLoss(f"saved job {job_id!r} under {self._jobs_key} does not parse: {exc}") from exc
        return job, None if submitter is None else _text(submitter)

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
                except NotLeader as exc:  # deposed: this snapshot is its successor's to write, not ours
                    self.refused += 1
                    logger.warning("job store: snapshot refused, not written (%s)", exc,
                                   extra={"job": job.status.job_id, "state": pb.JobState.Name(job.status.state)})
                    break
                except RedisError as exc:
                    logger.warning("job store: write failed, will retry", extra={"job": job.status.job_id,
                                                                                 "error": str(exc)})
                    await asyncio.sleep(_BACKOFF.delay(failures))
                    failures += 1
            self._queue.task_done()

    async def _write(self, job: pb.Job, submitter: str | None) -> None:
        """Submitter, order and snapshot in one atomic step, only while the fence holds this tenure.

        Raises:
            NotLeader: fenced, and the lease moved on (nothing written).
        """
        fence = self._fence() if self._fence is not None else None
        job_id = job.status.job_id
        written = await self._write_script(
            keys=[self._jobs_key, self._order_key, self._seq_key, self._submitters_key,
                  fence.key if fence else self._jobs_key],
            args=[job_id, job.SerializeToString(), submitter or "", str(fence.token) if fence else ""])
        if not written:
            raise NotLeader(f"the job-orchestrator lease moved on (this tenure's fence {fence.token if fence else 0})")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
