"""The topics monitoring-scorer consumes: the router's predictions and deployments, and the labels of
its own area (its contract's, as are the alerts it publishes: :mod:`opml_monitoring_scorer_contract.topics`)."""

from opml_inference_router_contract.topics import DEPLOYMENTS, PREDICTIONS
from opml_monitoring_scorer_contract.topics import LABELS

__all__ = ["DEPLOYMENTS", "LABELS", "PREDICTIONS"]
