"""The service's parts on their own: watch fan-out (a slow watcher is dropped, never waited for)
and the Redis job store (real Redis: order, snapshots, a corrupt record)."""

from __future__ import annotations

import asyncio

import pytest
from opml.jobs.v1 import jobs_pb2 as pb

from opml_common.config import PlatformSettings
from opml_common.errors import DataLoss, ResourceExhausted
from opml_common.storage import redis_client
from opml_job_orchestrator.state import JobStore
from opml_job_orchestrator.watch import WatchHub


def change(job_id: str, state: int = pb.JOB_STATE_RUNNING) -> pb.JobChange:
    return pb.JobChange(kind=pb.CHANGE_KIND_STARTED, status=pb.JobStatus(job_id=job_id, state=state))


async def test_watchers_get_their_jobs_changes_and_a_slow_one_is_dropped() -> None:
    hub = WatchHub(limit=3)
    with hub.subscribe(None) as everything, hub.subscribe("a") as only_a, hub.subscribe("b") as slow:
        for job_id in ("a", "b", "a"):
            hub.notify(change(job_id))
        assert [(await everything.next()).status.job_id for _ in range(3)] == ["a", "b", "a"]
        assert [(await only_a.next()).status.job_id for _ in range(2)] == ["a", "a"]
        for _ in range(3):
            hub.notify(change("b"))  # `slow` never reads: its backlog (1 + 3) passes the limit
        assert slow.dropped and not everything.dropped
        assert [(await everything.next()).status.job_id for _ in range(3)] == ["b", "b", "b"]
        for _ in range(3):
            await slow.next()
        with pytest.raises(ResourceExhausted, match="fell 3 changes behind"):
            await slow.next()
        hub.notify(change("b"))  # the dropped watcher is no longer offered anything
        assert (await everything.next()).status.job_id == "b"
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(slow.next(), 0.05)


async def test_job_store_keeps_submission_order_and_latest_snapshot(platform_settings: PlatformSettings) -> None:
    redis = redis_client(platform_settings)
    store = JobStore(redis, prefix=platform_settings.redis_prefix)
    await store.start()
    try:
        for job_id in ("b-first", "a-second"):
            store.save(pb.Job(name=f"jobs/{job_id}", status=pb.JobStatus(job_id=job_id, state=pb.JOB_STATE_PENDING)))
        store.save(pb.Job(name="jobs/b-first", status=pb.JobStatus(job_id="b-first", state=pb.JOB_STATE_RUNNING)))
        await asyncio.wait_for(store.flushed(), 5)
        loaded = await JobStore(redis, prefix=platform_settings.redis_prefix).load()
        assert [(j.status.job_id, j.status.state) for j in loaded] == [("b-first", pb.JOB_STATE_RUNNING),
                                                                        ("a-second", pb.JOB_STATE_PENDING)]
        assert await JobStore(redis, prefix=platform_settings.redis_prefix + "other:").load() == []
        await redis.hset(f"{platform_settings.redis_prefix}job-orchestrator:jobs", "a-second", b"\xff\xfe garbage")
        with pytest.raises(DataLoss, match="a-second"):
            await store.load()
    finally:
        await store.stop()
        await redis.aclose()
