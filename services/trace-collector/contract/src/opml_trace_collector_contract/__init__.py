"""The trace-collector's contract: what other services and users need to talk to it.

Its gRPC client, the topic traced jobs publish to with the sources the collector accepts there, its
event source, and the programs a job runner starts to trace a job without changing its code.
"""

from opml_trace_collector_contract.client import TraceCollectorClient
from opml_trace_collector_contract.names import EVENT_SOURCE, LAUNCHER_MODULE, SERVICE, SHIPPER_MODULE
from opml_trace_collector_contract.topics import TRACER_SOURCE_PREFIX, TRACES, tracer_source

__all__ = ["EVENT_SOURCE", "LAUNCHER_MODULE", "SERVICE", "SHIPPER_MODULE", "TRACER_SOURCE_PREFIX", "TRACES",
           "TraceCollectorClient", "tracer_source"]
