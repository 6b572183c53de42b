"""The monitoring-scorer's contract: what other services and users need to talk to it.

Its gRPC client, the name of a monitored model version, the topics of the monitoring area (the alerts
it publishes, the labels others publish for it to join to predictions), its event source and the source of
the platform's own labels.
"""

from opml_monitoring_scorer_contract.client import MonitoringClient
from opml_monitoring_scorer_contract.names import EVENT_SOURCE, LABEL_SOURCE, SERVICE, version_name
from opml_monitoring_scorer_contract.topics import ALERTS, LABELS

__all__ = ["ALERTS", "EVENT_SOURCE", "LABEL_SOURCE", "LABELS", "SERVICE", "MonitoringClient", "version_name"]
