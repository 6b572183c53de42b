"""The heterogeneity simulator: the coordinator's own :class:`~opml_fl_coordinator.federation.Federation`
and strategies, driven in virtual time by many virtual clients in one process."""

from opml_fl_coordinator.simulator.data import partition_digits
from opml_fl_coordinator.simulator.model import SoftmaxModel
from opml_fl_coordinator.simulator.runner import ClientTraits, SimulationResult, Simulator, heterogeneous_traits

__all__ = ["ClientTraits", "SimulationResult", "Simulator", "SoftmaxModel", "heterogeneous_traits",
           "partition_digits"]
