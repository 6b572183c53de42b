"""A bundle-store SIGKILLed between a change and its event (issue 12, item 6) loses no event.

A child process (core_child.py announce) makes the change with an emitter that kills it when
called: the store calls its emitter only once the change is durable, so the child dies exactly
between the manifest and the event, with nothing announced. The store opened again over the same
home announces the change, under the id written ahead of it, once; a change the child never made
(killed as it was about to write the manifest) is not announced. The last test does it with the real
service over the real broker."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from opml.bundles.v1 import events_pb2

from opml_bundle_store.core import BundleStore
from opml_bundle_store_contract.client import BundleStoreClient
from opml_bundle_store_contract.topics import BUNDLES
from opml_common.bus import CloudEvent
from opml_common.events import RecordingEmitter
from opml_common.storage import s3_client
from opml_devstack.testing.bus import read_records
from opml_devstack.testing.services import TOKENS

HERE = Path(__file__).parent


def _crash(home: Path, what: str, env: dict[str, str] | None = None) -> None:
    child = subprocess.run([sys.executable, str(HERE / "core_child.py"), "announce", str(home), "ctx", what],
                           check=False, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})
    assert child.returncode == -9 and "READY" in child.stdout, child.stdout + child.stderr  # SIGKILLed mid-way


def _intents(home: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted((home / "announcing").glob("*.json"))]


def _prepare(home: Path, remote_url: str | None = None, s3=None) -> dict[str, str]:
    with BundleStore(home, s3, events=RecordingEmitter()) as store:
        store.create_context("ctx", remote_url)
        uuids = {}
        for name, commit in (("draft", False), ("doomed", True), ("ready", True)):
            with store.new_bundle("ctx", name) as writer:
                writer.add_file("f", [name.encode()])
                uuids[name] = writer.finish(commit=commit).uuid
    assert _intents(home) == []  # announced, settled
    return uuids


@pytest.mark.parametrize(("op", "kind", "name"), [
    ("add", events_pb2.BundleCommitted, "crashing"),
    ("commit", events_pb2.BundleCommitted, "draft"),
    ("delete", events_pb2.BundleDeleted, "doomed"),
])
def test_a_change_whose_process_died_before_its_event_is_announced_at_the_next_start(
        tmp_path: Path, op: str, kind: type, name: str) -> None:
    home = tmp_path / "home"
    _prepare(home)
    _crash(home, f"{op}:after-change")
    [intent] = _intents(home)  # written ahead, never announced

    emitter = RecordingEmitter(source="opml/bundle-store")
    with BundleStore(home, None, events=emitter) as store:
        [(_, event)] = emitter.events
        assert event.id == intent["id"] and event.subject == name
        message = event.parse(kind)
        if kind is events_pb2.BundleCommitted:
            assert message.bundle.committed and store.get_bundle("ctx", name).committed
            assert message.bundle.uuid == store.get_bundle("ctx", name).uuid == intent["uuid"]
        else:
            assert message.bundle_name == name and name not in {b.name for b in store.list_bundles("ctx")}
    assert _intents(home) == []
    again = RecordingEmitter()
    with BundleStore(home, None, events=again):
        assert again.events == []  # settled once: no second announcement


@pytest.mark.parametrize("op", ["add", "commit", "delete"])
def test_a_change_the_process_died_before_making_is_not_announced(tmp_path: Path, op: str) -> None:
    home = tmp_path / "home"
    uuids = _prepare(home)
    _crash(home, f"{op}:before-change")
    assert len(_intents(home)) == 1
    emitter = RecordingEmitter()
    with BundleStore(home, None, events=emitter) as store:
        assert emitter.events == []
        assert not store.get_bundle("ctx", uuids["draft"]).committed
        assert store.get_bundle("ctx", "doomed").uuid == uuids["doomed"]
        assert "crashing" not in {b.name for b in store.list_bundles("ctx")}
    assert _intents(home) == []


def test_a_push_whose_process_died_before_its_event_is_announced_at_the_next_start(
        tmp_path: Path, platform_settings, settings_env: dict[str, str], remote_url: str) -> None:
    s3 = s3_client(platform_settings)
    home = tmp_path / "home"
    uuids = _prepare(home, remote_url, s3)
    _crash(home, "push:after-change", settings_env)
    [intent] = _intents(home)
    emitter = RecordingEmitter()
    with BundleStore(home, s3, events=emitter) as store:
        [(_, event)] = emitter.events
        assert event.id == intent["id"] and event.type == "opml.bundles.v1.BundlePushed"
        pushed = event.parse(events_pb2.BundlePushed)
        assert pushed.bundle.uuid == uuids["ready"] and pushed.remote_url == store.get_bundle("ctx", "ready").remote_url
    assert _intents(home) == []


def test_a_commit_whose_process_died_before_its_event_reaches_the_broker_from_the_restarted_service(
        start_service, platform_settings, tmp_path: Path) -> None:
    home = tmp_path / "home"
    _prepare(home)
    child = subprocess.run([sys.executable, str(HERE / "core_child.py"), "announce", str(home), "ctx", "add:after-change"],
                           check=False, capture_output=True, text=True, timeout=120)
    assert child.returncode == -9, child.stdout + child.stderr
    [intent] = _intents(home)

    service = start_service("bundle-store", extra_env={"OPML_BUNDLE_STORE_HOME": str(home)})
    [record] = asyncio.run(read_records(platform_settings, BUNDLES.full_name(platform_settings.topic_prefix), 1))
    event = CloudEvent.from_kafka(record.headers, record.value)
    assert (event.id, event.type, event.subject) == (intent["id"], "opml.bundles.v1.BundleCommitted", "crashing")
    with BundleStoreClient(service.target, token=TOKENS["reader"]) as client:
        assert client.get_bundle("ctx", "crashing").uuid == intent["uuid"]
    assert _intents(home) == []


def test_a_delete_that_fails_on_the_remote_announces_nothing_and_leaves_no_intent(
        tmp_path: Path, platform_settings, remote_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from opml_bundle_store.core.remote import S3Remote
    from opml_common.errors import Unavailable

    s3 = s3_client(platform_settings)
    home = tmp_path / "home"
    uuids = _prepare(home, remote_url, s3)

    def unreachable(self, keys):
        raise Unavailable("S3 is unreachable")

    monkeypatch.setattr(S3Remote, "delete", unreachable)
    emitter = RecordingEmitter()
    with BundleStore(home, s3, events=emitter) as store:
        with pytest.raises(Unavailable):
            store.delete_bundle("ctx", "doomed", remote=True)
        assert store.get_bundle("ctx", "doomed").uuid == uuids["doomed"]  # the local copy stays
    assert emitter.events == [] and _intents(home) == []
