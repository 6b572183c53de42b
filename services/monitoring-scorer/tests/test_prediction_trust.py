"""Whose predictions are scored, on the real broker, bundle-store and Redis with a real scorer.

Predictions were scored from any source: anyone who could write opml.predictions.v1 could fill a
model's windows, move its estimates and raise or silence its alerts. A prediction is scored only
from the inference-router's event source (OPML_MONITORING_SCORER_PREDICTION_SOURCES); any other is
dead-lettered as UntrustedSource and counted, and the router's own are never dead-lettered."""

from __future__ import annotations

import pytest

from opml_common.bus.cloudevents import CloudEvent
from opml_devstack.testing.bus import read_records
from opml_devstack.testing.metrics import samples, scrape
from opml_devstack.testing.services import env_prefix
from opml_inference_router_contract.names import EVENT_SOURCE as ROUTER_SOURCE
from opml_monitoring_scorer.__main__ import SPEC
from opml_monitoring_scorer.topics import PREDICTIONS

from .conftest import BATCH, WINDOW, Producer, wait_labelled, writer

pytestmark = pytest.mark.timeout(480)
EVIL = "evil/anyone"


async def test_predictions_from_another_source_are_dead_lettered_and_the_routers_are_scored(
        stack, world, platform_settings) -> None:
    scorer = stack.scorer().start()
    with writer(scorer) as client:
        client.register("fraud", "1", stack.context, "reference")
        async with Producer(platform_settings, ids="evil", source=EVIL) as evil, Producer(platform_settings) as router:
            await evil.send(world.rows(WINDOW))  # first on the version's partition: accepted, they would fill window 0
            await router.send(world.rows(WINDOW))
            dead = await read_records(platform_settings, PREDICTIONS.dead_letter(platform_settings.topic_prefix),
                                      WINDOW // BATCH)
            await router.send_labels(list(router.labels))
            (window,) = wait_labelled(client, "fraud", "1", [0])
    assert window.rows == WINDOW and window.labelled == WINDOW, "window 0 holds the router's rows, and all of them"
    for record in dead:
        headers = dict(record.headers)
        assert headers["opml_error_type"] == b"UntrustedSource", headers["opml_error"]
        assert CloudEvent.from_kafka(record.headers, record.value).source == EVIL
        assert b"'evil/anyone' is not a prediction producer" in headers["opml_error"]
        assert ROUTER_SOURCE.encode() in headers["opml_error"], "the reason names the sources accepted"
    page = samples(scrape(scorer.env[f"{env_prefix(SPEC)}METRICS_PORT"]))
    rejected = {s.labels["reason"]: s.value for s in page if s.name == "opml_monitoring_scorer_predictions_rejected_total"}
    assert rejected == {"malformed": 0, "untrusted": WINDOW // BATCH, "unscorable": 0}
