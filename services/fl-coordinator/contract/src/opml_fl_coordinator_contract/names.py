"""The fl-coordinator's name on the platform, the CloudEvents source of every event it publishes, its
resource names, and the metadata header a federation member's own token travels in.

Consumers that accept only the fl-coordinator's events (``EventConsumer(sources=...)``) name
:data:`EVENT_SOURCE` from here, never a copy of the string."""

from opml_common.events import event_source_of

SERVICE = "fl-coordinator"
EVENT_SOURCE = event_source_of(SERVICE)

CLIENT_TOKEN_HEADER = "x-opml-fl-client-token"
"""gRPC metadata key of a member's client token on every FederatedClientService call (the member's
identity; the platform token, if any, goes as usual)."""


def federation_name(federation_id: str) -> str:
    """The resource name of federation ``federation_id`` (``federations/<id>``)."""
    return f"federations/{federation_id}"
