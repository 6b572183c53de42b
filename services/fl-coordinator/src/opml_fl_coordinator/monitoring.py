"""The ``monitoring.yaml`` a served federated model's bundle carries, so the monitoring-scorer watches
it from its first prediction with no one registering rules.

The coordinator holds no data of its own (members evaluate on theirs, locally), so the bundle has no
``reference.npz``: the scorer takes the model's first window as the baseline, and with no labelled
reference there is no performance estimate. The rules are therefore on what it can see without one:
drift from that baseline and the share of bad input rows.
"""

from __future__ import annotations

import yaml

DRIFT_OVER = 0.3
"""Drift distance (normed Wasserstein / Jensen-Shannon) of any input column from the baseline that raises
the alert, two windows running."""
BAD_ROWS_OVER = 0.05
"""Share of a window's rows with missing, NaN or out-of-range inputs that raises the alert."""


def monitoring_config(window_count: int = 500) -> str:
    """The default ``monitoring.yaml`` of a dense classifier exported by :mod:`onnx_export`: its class
    scores are the ``probabilities`` output, and a window closes every ``window_count`` predictions."""
    return yaml.safe_dump({
        "task": "multiclass", "outputs": {"scores": "probabilities"}, "window": {"count": window_count},
        "rules": [{"name": "input-drift", "signal": "drift", "over": DRIFT_OVER, "for": 2},
                  {"name": "bad-input", "signal": "data_quality", "over": BAD_ROWS_OVER}],
    }, sort_keys=False)
