"""The bundle-store's name on the platform and the CloudEvents source of every event it publishes.

Consumers that accept only the bundle-store's events (``EventConsumer(sources=...)``) name
:data:`EVENT_SOURCE` from here, never a copy of the string."""

from opml_common.events import event_source_of

SERVICE = "bundle-store"
EVENT_SOURCE = event_source_of(SERVICE)
