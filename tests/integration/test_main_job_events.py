"""The main job's check of its events (scripts/story: the spans' bundle events, the loop's alert) on
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
from opml.monitoring.v1 import alert_events_pb2

from opml_bundle_store_contract.names import EVENT_SOURCE as BUNDLE_STORE_SOURCE
from opml_bundle_store_contract.topics import BUNDLES
from opml_common.bus import EventPublisher
from opml_common.config import PlatformSettings

ROOT = Path(__file__).resolve().parents[2]
COMMITTED, PUSHED = "opml.bundles.v1.BundleCommitted", "opml.bundles.v1.BundlePushed"


@pytest.fixture
def story(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    return SimpleNamespace(**{name: importlib.import_module(f"story.{name}")
                              for name in ("context", "data", "drift", "watch")})


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


def test_the_loops_alert_is_the_serving_versions_for_line_3_raised_after_the_lamps_changed(story: SimpleNamespace) -> None:
    """Step 5 waits for this alert: not an earlier one, not another version's, not another line's."""
    def seen(kind: str, message, at: float):
        return story.watch.Seen(kind, message, at, 0)

    def raised(version: str, segment: str, at: float):
        return seen("AlertRaised", alert_events_pb2.AlertRaised(model="inspection", version=version, rule="input-drift",
                                                                segment=segment), at)

    whole = [raised("2", "", 5.0), raised("1", "", 11.0), raised("2", "", 12.0)]
    assert story.drift.raised_for_line("2", 10.0, False)(whole) is whole[2], \
        "the version's own alert after the change, where windows are not split by line"
    found = story.drift.raised_for_line("2", 10.0, True)
    split = [raised("2", "", 11.0), raised("2", "1", 12.0), raised("2", "3", 9.0), raised("2", "3", 13.0)]
    assert found(split) is split[3], "line 3's, after the change, where the scorer splits the version by line"
    assert found(split[:3]) is None
