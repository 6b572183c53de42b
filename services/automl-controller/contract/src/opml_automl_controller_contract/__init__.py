"""The automl-controller's contract: what other services and users need to run experiments on it.

Its gRPC client, experiment and trial resource names, the experiments topic and its event source.
"""

from opml_common.lazy import lazy_exports

# Imported on first use: a core or a traced job that needs only names or topics stays free of the
# client's grpc (and whatever else a submodule needs).
_EXPORTS = {
    "EVENT_SOURCE": "names",
    "EXPERIMENTS": "topics",
    "ExperimentClient": "client",
    "SERVICE": "names",
    "experiment_name": "names",
    "trial_name": "names",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
