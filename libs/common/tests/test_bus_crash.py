"""Consumer processes SIGKILLed mid-stream and restarted: no event lost, no effect applied twice.

The handler (bus_consumer_proc.py) applies its effect in Redis in one MULTI with the dedup mark,
so a redelivered event is skipped: effectively exactly once, although delivery is at least once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from opml.bundles.v1 import bundles_pb2, events_pb2

from opml_common.bus import EventPublisher, ensure_topics
from opml_common.config import PlatformSettings
from opml_common.storage import redis_client
from opml_common.topics import Topic
from opml_devstack.testing.bus import fresh_metrics, wait_until

pytestmark = pytest.mark.timeout(150)

SCRIPT = Path(__file__).with_name("bus_consumer_proc.py")
EVENTS = 300
DELAY_MS = 5


def _spawn(topic: Topic, log_path: Path, *extra: int) -> subprocess.Popen:
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(
            [sys.executable, str(SCRIPT), topic.name, str(topic.partitions), "crash", str(DELAY_MS),
             *map(str, extra)],
            # OPML_* from the platform_settings fixture: the process uses this test's prefixes
            stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=dict(os.environ),
        )


async def test_sigkilled_consumer_loses_nothing_and_applies_nothing_twice(platform_settings: PlatformSettings,
                                                                       tmp_path: Path):
    topic = Topic("opml.bustest.crash.v1", 4)
    await ensure_topics(platform_settings, [topic])
    prefix = platform_settings.redis_prefix
    redis = redis_client(platform_settings)
    metrics, _ = fresh_metrics()
    ids: list[str] = []
    async with EventPublisher(platform_settings, source="test", metrics=metrics) as publisher:
        for i in range(EVENTS):
            message = events_pb2.BundleCommitted(bundle=bundles_pb2.Bundle(bundle_name=f"b{i}"))
            ids.append((await publisher.publish_proto(topic, message, subject=f"s{i % 17}")).id)

    async def handled() -> int:
        return await redis.llen(prefix + "handled")

    async def handled_at_least(minimum: int) -> bool:
        return await handled() >= minimum

    async def all_counted() -> bool:
        counts = await redis.mget([f"{prefix}count:{event_id}" for event_id in ids])
        return all(count is not None for count in counts)

    log_path = tmp_path / "consumers.log"
    processes: list[subprocess.Popen] = []
    try:
        # 1. killed at whatever point it has reached after 40 events
        first = _spawn(topic, log_path)
        processes.append(first)
        await wait_until(lambda: handled_at_least(40), timeout_s=40, what="the first process to handle 40 events")
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        at_kill = await handled()
        assert at_kill < EVENTS - 60, "the first process got too far before it was killed: slow the handler"

        # 2. killed right after an effect was applied and before its offset was committed
        hang_at = at_kill + 20
        second = _spawn(topic, log_path, hang_at)
        processes.append(second)
        await wait_until(lambda: handled_at_least(hang_at), timeout_s=40, what="the second process to hang")
        second.send_signal(signal.SIGKILL)
        second.wait(10)

        # 3. runs to the end and stops gracefully
        third = _spawn(topic, log_path)
        processes.append(third)
        await wait_until(all_counted, timeout_s=60, what=f"all {EVENTS} events to be handled")
        third.send_signal(signal.SIGTERM)  # finishes the event in hand, commits, leaves the group
        assert third.wait(15) == 0

        counts = await redis.mget([f"{prefix}count:{event_id}" for event_id in ids])
        assert [int(count) for count in counts] == [1] * EVENTS  # none lost, none applied twice
        assert await handled() == EVENTS
        # the event whose effect outlived process 2 was redelivered, and skipped
        assert int(await redis.get(prefix + "duplicates") or 0) >= 1
    except BaseException:
        print(log_path.read_text(errors="replace")[-8000:])
        raise
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait(10)
        keys = [key async for key in redis.scan_iter(match=prefix + "*", count=1000)]
        if keys:
            await redis.delete(*keys)
        await redis.aclose()
