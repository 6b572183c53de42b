"""The topic bundle-store publishes, as protos/opml/bundles/v1/events.proto declares it."""

from opml.bundles.v1 import events_pb2

from opml_common.topics import Topic

BUNDLES = Topic.of(events_pb2)
