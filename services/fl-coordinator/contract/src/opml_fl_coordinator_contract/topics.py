"""The topic fl-coordinator publishes, as protos/opml/fl/v1/events.proto declares it."""

from opml.fl.v1 import events_pb2

from opml_common.topics import Topic

FEDERATIONS = Topic.of(events_pb2)
