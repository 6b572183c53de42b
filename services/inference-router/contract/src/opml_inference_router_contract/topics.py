"""The topics inference-router publishes (protos/opml/inference/v1/events.proto and
deployment_events.proto): every prediction it serves, and every change to a deployment."""

from opml.inference.v1 import deployment_events_pb2, events_pb2

from opml_common.topics import Topic

PREDICTIONS = Topic.of(events_pb2)
DEPLOYMENTS = Topic.of(deployment_events_pb2)
