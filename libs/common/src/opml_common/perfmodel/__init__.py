"""Performance models of serving configurations that transfer between environments (pool kinds)
with a few measurements (Iqbal, Kotthoff, Jamshidi, OpML '19). Shared by the inference-router,
which places and sizes models on kinds it has not fully profiled, and the automl-controller.

Needs scikit-learn (the ``perfmodel`` extra of opml-common)."""

from opml_common.lazy import lazy_exports

# Imported on first use: a client that only builds a ServingConfig (the inference-router's contract)
# loads numpy, not scikit-learn, which the models need.
_EXPORTS = {
    "Influence": "influence", "influential_terms": "influence",
    "PerformanceModel": "learn", "mape": "learn",
    "OPTIONS": "space", "Sample": "space", "ServingConfig": "space", "grid": "space",
    "FromScratch": "transfer", "InfluenceTransfer": "transfer", "ModelShift": "transfer", "ScaleShift": "transfer",
    "SourceModel": "transfer", "TargetModel": "transfer",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
