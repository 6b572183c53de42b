"""The monitoring-scorer's name on the platform and the CloudEvents source of every event it publishes.

Consumers that accept only the monitoring-scorer's events (``EventConsumer(sources=...)``) name
:data:`EVENT_SOURCE` from here, never a copy of the string. :data:`LABEL_SOURCE` is the source of the
labels the platform's own label tools publish to ``opml.labels.v1``."""

from opml_common.events import event_source_of

SERVICE = "monitoring-scorer"
EVENT_SOURCE = event_source_of(SERVICE)
LABEL_SOURCE = f"{EVENT_SOURCE}/labels"
"""The CloudEvents source of labels sent through the platform's own label tools (reserved for
``opml monitor label``): the scorer accepts labels from it for every model by default
(``OPML_MONITORING_SCORER_LABEL_SOURCES``)."""


def version_name(model: str, version: str) -> str:
    """The resource name of a monitored model version: ``models/{model}/versions/{version}``."""
    return f"models/{model}/versions/{version}"
