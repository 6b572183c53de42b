"""Who may label a model's predictions, on the real broker, bundle-store and Redis with a real scorer.

Labels were joined from any source: 300 wrong labels from ``evil/anyone`` made the true accuracy of a
model right on every row 0.0, and the true labels sent after them were dropped as duplicates. A label
is applied only from the platform's label producers (``LABEL_SOURCE``) or one the model's
monitoring.yaml names (``QA_SOURCE`` here); any other is dead-lettered as UntrustedSource and counted.
A request's first label stays, unless its producer sends a newer one (a correction)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from opml_common.bus.cloudevents import CloudEvent
from opml_devstack.process import ServiceProcess
from opml_devstack.testing.bus import poll_until, read_records
from opml_devstack.testing.metrics import samples, scrape
from opml_devstack.testing.services import env_prefix
from opml_monitoring_scorer.__main__ import SPEC
from opml_monitoring_scorer.topics import LABELS
from opml_monitoring_scorer_contract.names import LABEL_SOURCE

from .conftest import QA_SOURCE, WINDOW, Producer, wait_labelled, wait_windows, writer

pytestmark = pytest.mark.timeout(480)
EVIL = "evil/anyone"


def labels_counted(process: ServiceProcess) -> dict[str, float]:
    """The process's opml_monitoring_scorer_labels_total by outcome."""
    page = samples(scrape(process.env[f"{env_prefix(SPEC)}METRICS_PORT"]))
    return {s.labels["outcome"]: s.value for s in page if s.name == "opml_monitoring_scorer_labels_total"}


async def test_labels_from_an_untrusted_source_are_dead_lettered_and_the_true_ones_after_them_count(
        stack, world, platform_settings) -> None:
    scorer = stack.scorer().start()
    rows = world.rows(WINDOW * 2)
    truth = [[float(v)] for v in rows.outputs.predicted]  # the model is right on every row
    wrong = [[1.0 - v[0]] for v in truth]
    with writer(scorer) as client:
        client.register("fraud", "1", stack.context, "reference")
        async with Producer(platform_settings) as producer:
            for i in range(300, 400):  # before their predictions
                await producer.send_label(f"req-{i}", wrong[i], source=EVIL)
            await producer.queue(rows)  # one-row requests req-0..399, two windows of 200
            wait_windows(client, "fraud", "1", 2, process=scorer)
            for i in range(200):  # after their predictions
                await producer.send_label(f"req-{i}", wrong[i], source=EVIL)
            for i in range(400):
                await producer.send_label(f"req-{i}", truth[i])
            labelled = wait_labelled(client, "fraud", "1", [0, 1])
        assert [(w.labelled, w.true_value) for w in labelled] == [(WINDOW, 1.0), (WINDOW, 1.0)]
        dead = await read_records(platform_settings, LABELS.dead_letter(platform_settings.topic_prefix), 300)
        assert len(dead) == 300
        for record in dead:
            headers = dict(record.headers)
            assert headers["opml_error_type"] == b"UntrustedSource", headers["opml_error"]
            assert CloudEvent.from_kafka(record.headers, record.value).source == EVIL
            assert b"'evil/anyone' is not a label producer of" in headers["opml_error"]
        counted = poll_until(lambda: (c := labels_counted(scorer)).get("joined") == 400 and c, what="400 joined")
        assert (counted["untrusted"], counted["duplicate"], counted["parked"]) == (300, 0, 0)


async def test_a_label_is_replaced_only_by_a_newer_one_of_its_producer(stack, world, platform_settings) -> None:
    """One window of 200 one-row requests of a model right on every row, labelled in three groups:
    A (req-0..49): the platform's label wrong, its correction right (replaces), an older one wrong
    (not applied: duplicate), then the QA producer's wrong (not applied: other_producer);
    B (req-50..99): the QA producer's wrong, its correction right, then the platform's wrong
    (other_producer); C (req-100..199): the platform's right."""
    scorer = stack.scorer().start()
    rows = world.rows(WINDOW)
    right = [float(v) for v in rows.outputs.predicted]
    t0 = datetime.now(UTC)
    with writer(scorer) as client:
        client.register("fraud", "1", stack.context, "reference")
        async with Producer(platform_settings) as producer:
            await producer.queue(rows)
            wait_windows(client, "fraud", "1", 1, process=scorer)

            async def label(i: int, value: float, source: str, seconds: float) -> None:
                await producer.send_label(f"req-{i}", [value], source=source, at=t0 + timedelta(seconds=seconds))

            for i in range(50):
                await label(i, 1 - right[i], LABEL_SOURCE, 0)
                await label(i, right[i], LABEL_SOURCE, 60)
                await label(i, 1 - right[i], LABEL_SOURCE, -60)
                await label(i, 1 - right[i], QA_SOURCE, 120)
            for i in range(50, 100):
                await label(i, 1 - right[i], QA_SOURCE, 0)
                await label(i, right[i], QA_SOURCE, 60)
                await label(i, 1 - right[i], LABEL_SOURCE, 120)
            for i in range(100, WINDOW):
                await label(i, right[i], LABEL_SOURCE, 0)
            expected = {"joined": 200, "corrected": 100, "duplicate": 50, "other_producer": 100, "untrusted": 0}
            poll_until(lambda: {k: labels_counted(scorer).get(k) for k in expected} == expected, timeout_s=180,
                       what=f"the labels counted as {expected}")
        (window,) = client.windows("fraud", "1")
        assert (window.labelled, window.true_value) == (WINDOW, 1.0)

