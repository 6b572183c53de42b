"""Performance models of serving configurations that transfer between environments (pool kinds)
with a few measurements (Iqbal, Kotthoff, Jamshidi, OpML '19). Shared by the inference-router,
which places and sizes models on kinds it has not fully profiled, and the automl-controller.

Needs scikit-learn (the ``perfmodel`` extra of opml-common)."""

import importlib
from typing import Any

# Names are imported on first use (PEP 562): a client that only builds a ServingConfig (the
# inference-router's contract) loads numpy, not scikit-learn, which the models need.
_EXPORTS = {
    "Influence": "influence", "influential_terms": "influence",
    "PerformanceModel": "learn", "mape": "learn",
    "OPTIONS": "space", "Sample": "space", "ServingConfig": "space", "grid": "space",
    "FromScratch": "transfer", "InfluenceTransfer": "transfer", "ModelShift": "transfer", "ScaleShift": "transfer",
    "SourceModel": "transfer", "TargetModel": "transfer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
