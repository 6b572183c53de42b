"""The topics automl-controller consumes (traces: the Trace collector kind), from their owners' contracts;
what it publishes is its contract's (:mod:`opml_automl_controller_contract.topics`)."""

from opml_trace_collector_contract.topics import TRACES

__all__ = ["TRACES"]
