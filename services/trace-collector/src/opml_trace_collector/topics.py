"""The topic traced jobs publish to and trace-collector consumes (protos/opml/traces/v1/events.proto)."""

from opml.traces.v1 import events_pb2

from opml_common.topics import Topic

TRACES = Topic.of(events_pb2)
