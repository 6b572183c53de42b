"""The topic automl-controller publishes (experiments), as protos/opml/automl/v1/events.proto declares it."""

from opml.automl.v1 import events_pb2

from opml_common.topics import Topic

EXPERIMENTS = Topic.of(events_pb2)
