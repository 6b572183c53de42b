"""The topics job-orchestrator publishes, as protos/opml/jobs/v1/events.proto and pipeline_events.proto declare them."""

from opml.jobs.v1 import events_pb2, pipeline_events_pb2

from opml_common.topics import Topic

JOBS = Topic.of(events_pb2)

PIPELINES = Topic.of(pipeline_events_pb2)
"""Pipeline runs: started, each step finished (ran, cached, failed, skipped), finished, blessings forced."""
