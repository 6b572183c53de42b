"""One suite for every EventEmitter (STYLE.md item 3): the outbox-backed one a service runs and the
recording one cores' unit tests use must behave alike, so a core tested on one works on the other."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from opml.bundles.v1 import bundles_pb2
from opml.bundles.v1 import events_pb2 as bundle_events_pb2
from opml.jobs.v1 import events_pb2 as job_events_pb2
from prometheus_client import CollectorRegistry

from opml_common.events import EventEmitter, OutboxEmitter, RecordingEmitter
from opml_common.metrics import ServiceMetrics
from opml_common.outbox import Outbox


class NeverCalled:
    async def publish(self, topic, event) -> None:
        raise AssertionError("emit() must not wait for the broker")


def _outbox_emitter(tmp_path: Path) -> EventEmitter:
    outbox = Outbox(tmp_path / "outbox", NeverCalled(), ServiceMetrics("emitter-test", CollectorRegistry()))
    return OutboxEmitter(outbox, source="opml/emitter-test")


def _recording_emitter(tmp_path: Path) -> EventEmitter:
    return RecordingEmitter(source="opml/emitter-test")


def _implementations() -> set[type]:
    """The platform's emitters (test doubles that other suites define are not implementations)."""
    found, todo = set(), [EventEmitter]
    while todo:
        for cls in todo.pop().__subclasses__():
            todo.append(cls)
            if cls.__module__.startswith("opml_"):
                found.add(cls)
    return found


MAKERS: dict[type, Callable[[Path], EventEmitter]] = {OutboxEmitter: _outbox_emitter,
                                                       RecordingEmitter: _recording_emitter}


def test_every_emitter_is_in_the_suite() -> None:
    assert _implementations() == set(MAKERS)


@pytest.fixture(params=sorted(MAKERS, key=lambda cls: cls.__name__), ids=lambda cls: cls.__name__)
def emitter(request: pytest.FixtureRequest, tmp_path: Path) -> EventEmitter:
    return MAKERS[request.param](tmp_path)


def test_an_event_carries_its_message_source_and_subject(emitter: EventEmitter) -> None:
    message = bundle_events_pb2.BundleDeleted(uuid="u1", bundle_name="defects")
    event = emitter.emit(message, subject="defects")
    assert event.type == "opml.bundles.v1.BundleDeleted"
    assert event.source == "opml/emitter-test" and event.subject == "defects"
    assert event.parse(bundle_events_pb2.BundleDeleted) == message


def test_each_event_gets_its_own_id(emitter: EventEmitter) -> None:
    first = emitter.emit(job_events_pb2.JobSubmitted(), subject="j1")
    second = emitter.emit(job_events_pb2.JobSubmitted(), subject="j1")
    assert first.id != second.id


def test_an_id_chosen_before_the_change_is_the_events_id(emitter: EventEmitter) -> None:
    """A write-ahead record announces a change again after a crash under the id it chose first."""
    first = emitter.emit(job_events_pb2.JobSubmitted(), subject="j1", id="chosen-before")
    again = emitter.emit(job_events_pb2.JobSubmitted(), subject="j1", id="chosen-before")
    assert first.id == again.id == "chosen-before"


def test_a_message_of_a_file_without_a_topic_is_refused(emitter: EventEmitter) -> None:
    with pytest.raises(ValueError, match="declares no topic"):
        emitter.emit(bundles_pb2.Bundle(), subject="x")
