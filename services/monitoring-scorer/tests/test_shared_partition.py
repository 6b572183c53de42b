"""Two versions on one partition of the predictions topic, their windows interleaved, and a scorer
restarted in between, on the real broker, bundle-store and Redis: every prediction is scored once.

The defect: a record was acked as soon as its window closed, while another version's open window on
the same partition still held an older record, and faust-streaming commits past one unacked offset
(or past any while the partition has no commit yet); the restarted scorer was fed from past the open
window's records, and they were never scored."""

from __future__ import annotations

import pytest
from aiokafka.partitioner import DefaultPartitioner

from opml_monitoring_scorer.topics import PREDICTIONS

from .conftest import WINDOW, Producer, wait_windows, writer

pytestmark = pytest.mark.timeout(480)


def versions_on_one_partition(model: str = "fraud") -> tuple[str, str]:
    """Two versions of ``model`` whose keys the producer's partitioner puts on one partition."""
    partitions = list(range(PREDICTIONS.partitions))
    at = {}
    for n in range(1, 1000):
        partition = DefaultPartitioner()(f"{model}/{n}".encode(), partitions, partitions)
        if partition in at:
            return at[partition], str(n)
        at[partition] = str(n)
    raise AssertionError("no two versions share a partition")


async def test_a_window_closed_on_a_shared_partition_does_not_commit_past_an_open_one(
        stack, world, platform_settings) -> None:
    held, closing = versions_on_one_partition()
    scorer = stack.scorer().start()
    with writer(scorer) as client:
        for version in (held, closing):
            client.register("fraud", version, stack.context, "reference")
    async with (Producer(platform_settings, version=held, ids="held") as older,
                Producer(platform_settings, version=closing, ids="closing") as newer):
        await older.send(world.rows(WINDOW // 2))  # an open window holds the partition's first records
        await newer.send(world.rows(WINDOW))  # a later window on the same partition closes
        with writer(scorer) as client:
            wait_windows(client, "fraud", closing, 1, process=scorer)
        scorer.stop()  # commits what is acked
        restarted = stack.scorer().start()
        await older.send(world.rows(WINDOW // 2))  # completes the held version's first window
        await newer.send(world.rows(WINDOW))  # after it on the partition: its close follows the other's
        with writer(restarted) as client:
            wait_windows(client, "fraud", closing, 2, process=restarted)
            for version, sent in ((held, WINDOW), (closing, 2 * WINDOW)):
                windows = client.windows("fraud", version, page_size=1000)
                assert sorted((w.index, w.rows) for w in windows) == [(i, WINDOW) for i in range(sent // WINDOW)], \
                    f"version {version}: every prediction scored once"
                assert client.status("fraud", version).predictions == sent
