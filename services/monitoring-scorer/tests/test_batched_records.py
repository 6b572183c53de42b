"""One-row predictions in PredictionBatch records of up to 7 (as the router publishes what is queued for a
version when requests come faster than its senders publish) scored by a real scorer on the real broker,
bundle-store and Redis: each record lands whole in the window open when it comes, by count and by time
(windows close on record boundaries, so a window by count holds 200 to 206 rows), late labels join each
batched prediction to its window, and a scorer SIGKILLed mid-stream and restarted loses no window and
counts none twice."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from opml_bundle_store_contract.client import BundleStoreClient
from opml_devstack.testing.services import TOKENS
from opml_monitoring_scorer.core.reference import performance
from opml_monitoring_scorer.core.scorer import dump_reference

from .conftest import (
    CONFIG,
    WINDOW,
    Producer,
    read_predictions,
    wait_labelled,
    wait_windows,
    windows_by_count,
    windows_by_time,
    writer,
)

pytestmark = pytest.mark.timeout(480)
RECORD = 7  # predictions per record at most: 200 is no multiple of it, so records straddle window bounds
SECONDS = 2.0


def of_version(records: list, version: str) -> list:
    return [r for r in records if r[1][0].model_version == version]


async def test_batched_one_row_predictions_land_whole_in_the_windows_their_records_start_in(
        stack, world, platform_settings) -> None:
    with BundleStoreClient(stack.store.target, token=TOKENS["writer"]) as client:
        timed = CONFIG.replace(f"window: {{count: {WINDOW}}}", f"window: {{count: 100000, seconds: {SECONDS}}}")
        client.add(stack.context, "timed", {"reference.npz": dump_reference(world.reference(3000)),
                                            "monitoring.yaml": timed.encode()}, commit=True)
    scorer = stack.scorer().start()
    with writer(scorer) as client:
        client.register("fraud", "1", stack.context, "reference")
        client.register("fraud", "2", stack.context, "timed")
        rows = world.rows(WINDOW * 4 + 50)
        timed_rows = world.rows(300)
        async with (Producer(platform_settings, batch_max=RECORD) as producer,
                    Producer(platform_settings, version="2", batch_max=RECORD, ids="timed") as timed_producer):
            await producer.queue(rows)  # all at once: records of 7 (the last of 3)
            # 50 ms apart in event time: a window of 2 s holds the records that start within its 2 s
            await timed_producer.queue(timed_rows, times=time.time() + 0.05 * np.arange(300))
            records = await read_predictions(platform_settings, len(rows.outputs) + 300)
            assert {t for t, _ in records} == {"opml.inference.v1.PredictionBatch"}, "batched: all queued at once"
            assert max(len(p) for _, p in records) == RECORD
            by_count = windows_by_count(of_version(records, "1"), WINDOW)
            by_time = windows_by_time(of_version(records, "2"), SECONDS)
            assert len(by_count) == 4 and any(len(w) > WINDOW for w in by_count), "a record straddles a bound"
            assert len(by_time) >= 5

            found = wait_windows(client, "fraud", "1", len(by_count), process=scorer)
            assert [w.index for w in found] == list(range(len(by_count)))
            assert [w.rows for w in found] == [len(w) for w in by_count]
            found_timed = wait_windows(client, "fraud", "2", len(by_time), process=scorer)
            assert [w.rows for w in found_timed] == [len(w) for w in by_time]
            for window in found_timed:  # records start within the span; a record's tail (6 x 50 ms) may pass it
                span = (window.last_time.ToNanoseconds() - window.first_time.ToNanoseconds()) / 1e9
                assert span < SECONDS + 0.05 * (RECORD - 1) + 1e-6, span

            # every batched prediction joins its label in its own window: each window's truth is its rows'
            await producer.send_labels([request_id for window in by_count for request_id in window])
            labelled = wait_labelled(client, "fraud", "1", list(range(len(by_count))))
            for window, ids in zip(labelled, by_count, strict=True):
                index = np.array([int(request_id.split("-")[1]) for request_id in ids])
                assert window.true_value == pytest.approx(performance(world.task, rows.outputs.predicted[index],
                                                                      rows.labels[index]))


async def test_sigkill_and_restart_with_batch_records_loses_no_window_and_counts_nothing_twice(
        stack, world, platform_settings) -> None:
    scorer = stack.scorer().start()
    with writer(scorer) as client:
        client.register("fraud", "1", stack.context, "reference")
    total = WINDOW * 8
    async with Producer(platform_settings, batch_max=RECORD) as producer:
        # 70 at a time: records of 7 keep coming while the scorer is killed
        sending = asyncio.create_task(producer.queue(world.rows(total), chunk=70))
        with writer(scorer) as client:
            await asyncio.to_thread(wait_windows, client, "fraud", "1", 2, process=scorer)
        scorer.kill()  # SIGKILL while batch records are still arriving
        await sending
    expected = windows_by_count(await read_predictions(platform_settings, total), WINDOW)
    assert len(expected) >= 7 and any(len(w) > WINDOW for w in expected)
    restarted = stack.scorer().start()
    with writer(restarted) as client:
        found = wait_windows(client, "fraud", "1", len(expected), process=restarted)
        assert [w.index for w in found] == list(range(len(expected))), "no window lost, none twice"
        assert [w.rows for w in found] == [len(w) for w in expected], "no prediction lost or counted twice"
        assert client.status("fraud", "1").predictions == sum(len(w) for w in expected)
