"""The main job's check of its events (scripts/story: the spans' bundle events, the served prediction) on
the real broker.

It reads each topic from its start, where earlier runs' events are too: it used to accept any event
of the subject, so a run whose own event never came passed on an earlier run's, and it waited 30 s
per poll with no overall bound, so `make up` could hang. Now only this run's events count, and a
step fails after its deadline, naming what did not come."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import SimpleNamespace

import pytest
from opml.bundles.v1 import bundles_pb2, events_pb2
from opml.inference.v1 import events_pb2 as inference_events

from opml_bundle_store_contract.names import EVENT_SOURCE as BUNDLE_STORE_SOURCE
from opml_bundle_store_contract.topics import BUNDLES
from opml_common.bus import EventPublisher
from opml_common.config import PlatformSettings

ROOT = Path(__file__).resolve().parents[2]
COMMITTED, PUSHED = "opml.bundles.v1.BundleCommitted", "opml.bundles.v1.BundlePushed"


@pytest.fixture
def story(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    return SimpleNamespace(**{name: importlib.import_module(f"story.{name}") for name in ("context", "data", "serve")})


async def publish(settings: PlatformSettings, *messages) -> None:
    publisher = EventPublisher(settings, source=BUNDLE_STORE_SOURCE, metrics=None)
    await publisher.start()
    try:
        for message in messages:
            await publisher.publish_proto(BUNDLES, message, subject="inspections")
    finally:
        await publisher.stop()


def bundle(uuid: str) -> bundles_pb2.Bundle:
    return bundles_pb2.Bundle(uuid=uuid, bundle_name="inspections")


async def test_only_this_runs_bundle_events_count_and_a_missing_one_fails_in_time(
        story: SimpleNamespace, platform_settings: PlatformSettings, capsys: pytest.CaptureFixture) -> None:
    topic = BUNDLES.full_name(platform_settings.topic_prefix)
    bootstrap = platform_settings.kafka_bootstrap
    await publish(platform_settings, events_pb2.BundleCommitted(bundle=bundle("earlier")),
                  events_pb2.BundlePushed(bundle=bundle("earlier")), events_pb2.BundleCommitted(bundle=bundle("ours")))
    ours = story.data.of_bundles({"ours"})
    await story.context._show_events(bootstrap, topic, {COMMITTED}, ours, 60.0)
    printed = capsys.readouterr().out.splitlines()
    assert [line.rsplit("offset=", 1)[1] for line in printed] == ["2"], "this run's commit only"
    # whether or not its commit was read again in time (a loaded machine), the push is named missing
    with pytest.raises(SystemExit, match=rf"{PUSHED} did not reach {topic} within 5 s$"):
        await story.context._show_events(bootstrap, topic, {COMMITTED, PUSHED}, ours, 5.0)
    capsys.readouterr()

    await publish(platform_settings, events_pb2.BundlePushed(bundle=bundle("ours")))
    await story.context._show_events(bootstrap, topic, {COMMITTED, PUSHED}, ours, 60.0)
    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in printed] == [COMMITTED, PUSHED]
    assert [line.rsplit("offset=", 1)[1] for line in printed] == ["2", "3"], "not the earlier run's at 0 and 1"


def test_this_runs_prediction_is_told_by_its_version_and_request_id(story: SimpleNamespace) -> None:
    ours = story.serve.of_request(3, "main-job-abc")
    made = "opml.inference.v1.PredictionMade"

    def value(request_id: str) -> bytes:
        return inference_events.PredictionMade(request_id=request_id).SerializeToString()

    assert ours(made, "defect-classifier/3", value("main-job-abc"))
    assert not ours(made, "defect-classifier/3", value("main-job-earlier")), "an earlier run's, same version"
    assert not ours(made, "defect-classifier/2", value("main-job-abc"))
