"""The monitoring-scorer's contract: what other services and users need to talk to it.

Its gRPC clients (blocking, and asyncio for a service's event loop), the name of a monitored model
version, the topics of the monitoring area (the alerts and the windows' quality it publishes, the
labels others publish for it to join to predictions), its event source, the source of the platform's
own labels, and the reference set a model bundle carries to be monitored.
"""

from opml_common.lazy import lazy_exports

# Imported on first use: a core or a traced job that needs only names or topics stays free of the
# client's grpc (and whatever else a submodule needs).
_EXPORTS = {
    "ALERTS": "topics",
    "AsyncMonitoringClient": "aioclient",
    "EVENT_SOURCE": "names",
    "LABELS": "topics",
    "LABEL_SOURCE": "names",
    "MONITORING_FILE": "reference",
    "MonitoringClient": "client",
    "QUALITY": "topics",
    "REFERENCE_FILE": "reference",
    "SERVICE": "names",
    "reference_npz": "reference",
    "version_name": "names",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
