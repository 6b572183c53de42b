"""The trace-collector's contract: what other services and users need to talk to it.

Its gRPC client, the topic traced jobs publish to with the sources the collector accepts there, its
event source, and the programs a job runner starts to trace a job without changing its code.
"""

from opml_common.lazy import lazy_exports

# Imported on first use: a core or a traced job that needs only names or topics stays free of the
# client's grpc (and whatever else a submodule needs).
_EXPORTS = {
    "EVENT_SOURCE": "names",
    "LAUNCHER_MODULE": "names",
    "SERVICE": "names",
    "SHIPPER_MODULE": "names",
    "TRACER_SOURCE_PREFIX": "topics",
    "TRACES": "topics",
    "TraceCollectorClient": "client",
    "tracer_source": "topics",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
