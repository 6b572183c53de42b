"""Every Kafka topic of the platform, named and versioned in one place.

Topic names are ``opml.<family>.v<N>``; a breaking change of an event family gets a new topic.
``OPML_TOPIC_PREFIX`` is prepended at run time (tests use a unique prefix per run). Each topic
has a dead-letter companion ``<topic>.dlq`` for events its consumers could not handle.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topic:
    name: str
    partitions: int = 4
    description: str = ""

    def full_name(self, prefix: str = "") -> str:
        return prefix + self.name

    def dead_letter(self, prefix: str = "") -> str:
        return prefix + self.name + ".dlq"


BUNDLES = Topic("opml.bundles.v1", 4, "bundle committed / pushed / deleted (bundle-store)")

ALL_TOPICS: tuple[Topic, ...] = (BUNDLES,)
