"""The topics inference-router publishes (predictions, deployments) and consumes (bundles), as their
events proto files declare them."""

from opml.bundles.v1 import events_pb2 as bundle_events_pb2
from opml.inference.v1 import deployment_events_pb2, events_pb2

from opml_common.topics import Topic

PREDICTIONS = Topic.of(events_pb2)
DEPLOYMENTS = Topic.of(deployment_events_pb2)
BUNDLES = Topic.of(bundle_events_pb2)
