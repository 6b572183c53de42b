"""The inference-router's name on the platform and the CloudEvents source of every event it publishes.

Consumers that accept only the inference-router's events (``EventConsumer(sources=...)``) name
:data:`EVENT_SOURCE` from here, never a copy of the string."""

from opml_common.events import event_source_of

SERVICE = "inference-router"
EVENT_SOURCE = event_source_of(SERVICE)
