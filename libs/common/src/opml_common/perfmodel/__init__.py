"""Performance models of serving configurations that transfer between environments (pool kinds)
with a few measurements (Iqbal, Kotthoff, Jamshidi, OpML '19). Shared by the inference-router,
which places and sizes models on kinds it has not fully profiled, and the automl-controller.

Needs scikit-learn (the ``perfmodel`` extra of opml-common)."""

from opml_common.perfmodel.influence import Influence, influential_terms
from opml_common.perfmodel.learn import PerformanceModel, mape
from opml_common.perfmodel.space import OPTIONS, Sample, ServingConfig, grid
from opml_common.perfmodel.transfer import (
           FromScratch,
           InfluenceTransfer,
           ModelShift,
           ScaleShift,
           SourceModel,
           TargetModel,
)

__all__ = ["OPTIONS", "FromScratch", "Influence", "InfluenceTransfer", "ModelShift", "PerformanceModel", "Sample",
           "ScaleShift", "ServingConfig", "SourceModel", "TargetModel", "grid", "influential_terms", "mape"]
