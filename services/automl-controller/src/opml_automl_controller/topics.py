"""The topics automl-controller publishes (experiments) and consumes (traces: the Trace collector kind),
as their events proto files declare them."""

from opml.automl.v1 import events_pb2
from opml.traces.v1 import events_pb2 as trace_events_pb2

from opml_common.topics import Topic

EXPERIMENTS = Topic.of(events_pb2)
TRACES = Topic.of(trace_events_pb2)
