"""The topic traced jobs publish to and trace-collector consumes (protos/opml/traces/v1/events.proto), and
the sources its events may come from."""

from opml.traces.v1 import events_pb2

from opml_common.topics import Topic

TRACES = Topic.of(events_pb2)

# Every tracer publishes as opml://trace-collector/tracer/<job>/<worker> (inject.sender); the collector
# accepts only this family of sources, and only events whose data names that same job and worker.
TRACER_SOURCE_PREFIX = "opml://trace-collector/tracer/"


def tracer_source(job: str, worker: str) -> str:
    """The CloudEvents source of the tracer of ``worker`` of ``job``."""
    return f"{TRACER_SOURCE_PREFIX}{job}/{worker}"
