"""The topic job-orchestrator publishes, as protos/opml/jobs/v1/events.proto declares it."""

from opml.jobs.v1 import events_pb2

from opml_common.topics import Topic

JOBS = Topic.of(events_pb2)
