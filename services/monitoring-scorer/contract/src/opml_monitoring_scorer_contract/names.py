"""The monitoring-scorer's name on the platform and the CloudEvents source of every event it publishes.

Consumers that accept only the monitoring-scorer's events (``EventConsumer(sources=...)``) name
:data:`EVENT_SOURCE` from here, never a copy of the string."""

from opml_common.events import event_source_of

SERVICE = "monitoring-scorer"
EVENT_SOURCE = event_source_of(SERVICE)


def version_name(model: str, version: str) -> str:
    """The resource name of a monitored model version: ``models/{model}/versions/{version}``."""
    return f"models/{model}/versions/{version}"
