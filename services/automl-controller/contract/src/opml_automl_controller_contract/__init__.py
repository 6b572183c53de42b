"""The automl-controller's contract: what other services and users need to run experiments on it.

Its gRPC client, experiment and trial resource names, the experiments topic and its event source.
"""

from opml_automl_controller_contract.client import ExperimentClient
from opml_automl_controller_contract.names import EVENT_SOURCE, SERVICE, experiment_name, trial_name
from opml_automl_controller_contract.topics import EXPERIMENTS

__all__ = ["EVENT_SOURCE", "EXPERIMENTS", "SERVICE", "ExperimentClient", "experiment_name", "trial_name"]
