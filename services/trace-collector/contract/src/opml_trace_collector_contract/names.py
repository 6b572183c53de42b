"""The trace-collector's name on the platform and the CloudEvents source of every event it publishes.

Consumers that accept only the trace-collector's events (``EventConsumer(sources=...)``) name
:data:`EVENT_SOURCE` from here, never a copy of the string."""

from opml_common.events import event_source_of

SERVICE = "trace-collector"
EVENT_SOURCE = event_source_of(SERVICE)

# The programs a job runner starts to trace a job with no change to its code: the launcher wraps each
# traced task (``python -m LAUNCHER_MODULE --job J --worker ROLE-INDEX -- ARGV``) and the shipper
# publishes what traced tasks spooled. Both come with the trace-collector's package, installed where
# traced jobs run.
LAUNCHER_MODULE = "opml_trace_collector.inject.run"
SHIPPER_MODULE = "opml_trace_collector.inject.ship"
