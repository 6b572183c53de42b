"""The core announces its changes: one event per commit, push and delete, from the store itself
(RecordingEmitter stands for the service's outbox)."""

from __future__ import annotations

from pathlib import Path

import pytest
from opml.bundles.v1 import events_pb2

from opml_bundle_store.core import BundleStore
from opml_bundle_store_contract.topics import BUNDLES
from opml_common.errors import NotFound
from opml_common.events import RecordingEmitter


@pytest.fixture
def emitter() -> RecordingEmitter:
    return RecordingEmitter(source="opml/bundle-store")


@pytest.fixture
def store(tmp_path: Path, emitter: RecordingEmitter):
    with BundleStore(tmp_path / "home", None, events=emitter) as opened:
        opened.create_context("ctx")
        yield opened


def add(store: BundleStore, name: str, *, commit: bool = False, tags: dict[str, str] | None = None):
    with store.new_bundle("ctx", name, tags=tags) as writer:
        writer.add_file("f", [name.encode()])
        return writer.finish(commit=commit)


def test_adding_announces_only_a_committed_bundle(store: BundleStore, emitter: RecordingEmitter) -> None:
    add(store, "draft")
    assert emitter.messages == []
    committed = add(store, "model", commit=True, tags={"stage": "candidate"})
    [(topic, event)] = emitter.events
    assert topic == BUNDLES and event.type == "opml.bundles.v1.BundleCommitted"
    assert event.subject == "model" and event.source == "opml/bundle-store"
    message = event.parse(events_pb2.BundleCommitted)
    assert message.bundle.uuid == committed.uuid and message.bundle.committed
    assert message.bundle.tags["stage"] == "candidate" and [f.path for f in message.bundle.files] == ["f"]


def test_every_commit_call_announces_the_bundle(store: BundleStore, emitter: RecordingEmitter) -> None:
    draft = add(store, "model")
    first = store.commit("ctx", draft.uuid)
    again = store.commit("ctx", draft.uuid)  # idempotent, announced again (consumers deduplicate)
    assert again == first
    assert [m.bundle.uuid for m in emitter.messages] == [draft.uuid, draft.uuid]
    assert all(isinstance(m, events_pb2.BundleCommitted) and m.bundle.committed for m in emitter.messages)


def test_delete_announces_the_deleted_bundle(store: BundleStore, emitter: RecordingEmitter) -> None:
    bundle = add(store, "model", tags={"team": "a"})
    assert store.delete_bundle("ctx", "model") == [bundle.uuid]
    [message] = emitter.messages
    assert message == events_pb2.BundleDeleted(context="ctx", uuid=bundle.uuid, bundle_name="model",
                                               tags={"team": "a"}, remote=False)
    assert emitter.events[0][1].subject == "model"


def test_failed_changes_announce_nothing(store: BundleStore, emitter: RecordingEmitter) -> None:
    with pytest.raises(NotFound):
        store.commit("ctx", "nope")
    with pytest.raises(NotFound):
        store.delete_bundle("ctx", "nope")
    with store.new_bundle("ctx", "aborted") as writer:
        writer.add_file("f", [b"x"])  # left without finish(): aborted
    assert emitter.messages == []


def test_a_store_without_an_emitter_announces_nothing(tmp_path: Path) -> None:
    with BundleStore(tmp_path / "home", None) as store:  # a tool or benchmark using the store directly
        store.create_context("ctx")
        assert store.commit("ctx", add(store, "model").uuid).committed
