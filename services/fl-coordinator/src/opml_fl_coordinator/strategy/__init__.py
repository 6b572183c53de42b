"""Aggregation strategies behind one ABC (:class:`Strategy`), in Flower's manner."""

from opml_fl_coordinator.strategy.base import Failure, FitIns, FitRes, Strategy
from opml_fl_coordinator.strategy.bounded import BoundedInfluence
from opml_fl_coordinator.strategy.dp import DifferentialPrivacyFixedClipping
from opml_fl_coordinator.strategy.fedavg import FedAvg, FedProx
from opml_fl_coordinator.strategy.fedopt import FedAdam, FedYogi
from opml_fl_coordinator.strategy.robust import FedMedian, FedTrimmedAvg

__all__ = ["BoundedInfluence", "DifferentialPrivacyFixedClipping", "FedAdam", "FedAvg", "FedMedian", "FedProx",
           "FedTrimmedAvg", "FedYogi", "Failure", "FitIns", "FitRes", "Strategy"]
