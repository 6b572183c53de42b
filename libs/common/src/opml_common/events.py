"""Where a service's core announces what changed: one domain event, at the place the change happens.

A core gets an :class:`EventEmitter` and calls ``emit(message, subject=...)`` once per domain change
(a bundle committed, a job preempted, a model deployed). The topic comes from the message's own events
proto file (:meth:`Topic.of`), so an event cannot land on the wrong topic; the source is the service's.
Servicers and ``__main__`` never build or publish events. In a running service the emitter is an
:class:`OutboxEmitter` (made by :func:`opml_common.service.run_service`): the event is on disk before
``emit`` returns and the outbox publishes it, at least once. Unit tests of a core use
:class:`RecordingEmitter`.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod

from google.protobuf.descriptor import FileDescriptor
from google.protobuf.message import Message

from opml_common.bus.cloudevents import CloudEvent
from opml_common.outbox import Outbox
from opml_common.topics import Topic


def event_source_of(service: str) -> str:
    """The CloudEvents ``source`` of every event ``service`` publishes (``opml/bundle-store``)."""
    return f"opml/{service}"


class EventEmitter(ABC):
    """The one way a core publishes domain events."""

    @abstractmethod
    def emit(self, message: Message, *, subject: str, id: str | None = None) -> CloudEvent:
        """Announce ``message`` (a message of an events proto file) about ``subject`` (its Kafka key:
        the thing that changed, so one thing's events stay in order). Called by the core right after
        the change is durable; returns the CloudEvent made. Safe to call from any thread.

        ``id``: the event's id (default a new uuid4). A core that chose it before the change (a
        write-ahead record) announces the same change again under the same id after a crash, so
        consumers that deduplicate by id apply it once.

        Raises:
            ValueError: the message's proto file declares no topic.
            OSError: the event could not be recorded (the disk is full or gone); the change it
                announces has happened, so callers decide whether that fails the request.
        """


@functools.cache
def _topic_of(file: FileDescriptor) -> Topic:
    return Topic.of(file)


def topic_of(message: Message) -> Topic:
    """The topic ``message`` travels on, read once per proto file."""
    return _topic_of(message.DESCRIPTOR.file)


class OutboxEmitter(EventEmitter):
    """Records every event in the service's durable outbox, which publishes it in the background."""

    def __init__(self, outbox: Outbox, *, source: str) -> None:
        self._outbox = outbox
        self.source = source

    def emit(self, message: Message, *, subject: str, id: str | None = None) -> CloudEvent:
        event = CloudEvent.from_proto(message, source=self.source, subject=subject, id=id)
        self._outbox.record(topic_of(message), event)
        return event

    def with_source(self, source: str) -> OutboxEmitter:
        """An emitter into the same outbox under another source (a service that publishes on behalf of
        a role of its own, e.g. the platform's label tools)."""
        return OutboxEmitter(self._outbox, source=source)


class RecordingEmitter(EventEmitter):
    """Keeps emitted events in memory, in order, for unit tests of a core (``events``, ``messages``)."""

    def __init__(self, *, source: str = "opml/test") -> None:
        self.source = source
        self.events: list[tuple[Topic, CloudEvent]] = []
        self.messages: list[Message] = []

    def emit(self, message: Message, *, subject: str, id: str | None = None) -> CloudEvent:
        event = CloudEvent.from_proto(message, source=self.source, subject=subject, id=id)
        self.events.append((topic_of(message), event))
        self.messages.append(message)
        return event

    def with_source(self, source: str) -> RecordingEmitter:
        """A recorder of its own under another source."""
        return RecordingEmitter(source=source)
