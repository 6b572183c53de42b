"""The topics monitoring-scorer publishes (alerts) and consumes (predictions, labels, deployments),
from their events protos."""

from opml.inference.v1 import deployment_events_pb2
from opml.inference.v1 import events_pb2 as prediction_events_pb2
from opml.monitoring.v1 import alert_events_pb2, label_events_pb2

from opml_common.topics import Topic

ALERTS = Topic.of(alert_events_pb2)
LABELS = Topic.of(label_events_pb2)
PREDICTIONS = Topic.of(prediction_events_pb2)
DEPLOYMENTS = Topic.of(deployment_events_pb2)
