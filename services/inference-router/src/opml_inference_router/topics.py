"""The topics inference-router publishes (predictions, deployments) and consumes (bundles), as their
events proto files declare them."""

from opml.inference.v1 import deployment_events_pb2, events_pb2

from opml_bundle_store_contract.topics import BUNDLES
from opml_common.topics import Topic

PREDICTIONS = Topic.of(events_pb2)
DEPLOYMENTS = Topic.of(deployment_events_pb2)

__all__ = ["BUNDLES", "DEPLOYMENTS", "PREDICTIONS"]
