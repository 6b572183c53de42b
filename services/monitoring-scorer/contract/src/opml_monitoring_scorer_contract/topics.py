"""The topics of the monitoring area (protos/opml/monitoring/v1/alert_events.proto,
quality_events.proto and label_events.proto): the alerts and the windows' quality monitoring-scorer
publishes, and the labels it joins to predictions (published by whoever learns a prediction's true
value, keyed by request id)."""

from opml.monitoring.v1 import alert_events_pb2, label_events_pb2, quality_events_pb2

from opml_common.topics import Topic

ALERTS = Topic.of(alert_events_pb2)
QUALITY = Topic.of(quality_events_pb2)
"""WindowScored: each scored window of a version (estimate, truth so far), again as labels join it."""
LABELS = Topic.of(label_events_pb2)
