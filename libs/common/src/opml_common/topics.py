"""Kafka topics, as each events proto file declares them.

Every ``*events.proto`` names its topic with the file option ``(opml.events.v1.topic)`` (see
protos/opml/events/v1/topic.proto), so the contract of an event family (its messages, topic name and
partitions) is written once, beside the messages, and read here. libs/common keeps no list of the
platform's topics: a service gets its own with ``Topic.of(events_pb2)`` and a consumer of another
service's events reads the same declaration from the shared protos package.

Topic names are ``opml.<family>.v<N>``; a breaking change of an event family gets a new topic.
``OPML_TOPIC_PREFIX`` is prepended at run time (tests use a unique prefix per run). Each topic
has a dead-letter companion ``<topic>.dlq`` for events its consumers could not handle.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import ModuleType

from google.protobuf.descriptor import Descriptor, FileDescriptor
from google.protobuf.message import Message
from opml.events.v1 import topic_pb2

_NAME = re.compile(r"^opml\.[a-z][a-z0-9_-]*\.v[0-9]+$")


@dataclass(frozen=True)
class Topic:
    """One event family's topic. Create it with :meth:`of`; direct construction is for tests' own topics."""

    name: str
    partitions: int = 4
    description: str = ""

    @classmethod
    def of(cls, source: ModuleType | FileDescriptor | Descriptor | Message | type[Message]) -> Topic:
        """The topic an events proto file declares: pass its ``*_pb2`` module, one of its messages
        (class or instance) or a descriptor.

        Raises:
            ValueError: the file declares no ``(opml.events.v1.topic)`` option, or a malformed one.
        """
        file = _file_descriptor(source)
        options = file.GetOptions()
        if not options.HasExtension(topic_pb2.topic):
            raise ValueError(f"{file.name} declares no topic: add `option (opml.events.v1.topic) = {{...}};`")
        declared = options.Extensions[topic_pb2.topic]
        if not _NAME.match(declared.name):
            raise ValueError(f"{file.name}: topic `name` must look like opml.<family>.v<N>, but got {declared.name!r}")
        if declared.partitions < 1:
            raise ValueError(f"{file.name}: topic `partitions` must be >= 1, but got {declared.partitions}")
        return cls(declared.name, declared.partitions, declared.description)

    def full_name(self, prefix: str = "") -> str:
        return prefix + self.name

    def dead_letter(self, prefix: str = "") -> str:
        return prefix + self.name + ".dlq"


def _file_descriptor(source: object) -> FileDescriptor:
    if isinstance(source, FileDescriptor):
        return source
    if isinstance(source, Descriptor):
        return source.file
    descriptor = getattr(source, "DESCRIPTOR", None)
    if isinstance(descriptor, FileDescriptor):
        return descriptor
    if isinstance(descriptor, Descriptor):
        return descriptor.file
    raise TypeError(f"`source` must be a *_pb2 module, a message or a descriptor, but got {type(source).__name__}")
