"""The ``monitoring.yaml`` a served federated model's bundle carries, so the monitoring-scorer watches
it from its first prediction with no one registering rules.

The coordinator holds no training data (members evaluate on theirs, locally). Without a federation
``holdout`` the bundle has no ``reference.npz``: the scorer takes the model's first window as the
baseline, and with no labelled reference there is no performance estimate, so the rules are on what
it can see without one: drift from that baseline and the share of bad input rows (its bound above what
clean rows show against ranges taken from that many rows: the scorer contract's ``bad_input_over``). With a holdout
(:mod:`holdout`) the bundle carries a labelled reference, and a rule on the estimated accuracy is
added: it alerts when the estimate falls ``ACCURACY_DROP`` below the model's accuracy on the holdout.
"""

from __future__ import annotations

import yaml

from opml_monitoring_scorer_contract.reference import bad_input_over

DRIFT_OVER = 0.3
"""Drift distance (normed Wasserstein / Jensen-Shannon) of any input column from the baseline that raises
the alert, two windows running."""
ACCURACY_DROP = 0.10
"""Fall of the estimated accuracy below the holdout accuracy that raises the alert, three windows running."""


def monitoring_config(window_count: int = 500, *, columns: int, reference_rows: int | None = None,
                      holdout_accuracy: float | None = None) -> str:
    """The default ``monitoring.yaml`` of a dense classifier of ``columns`` inputs exported by
    :mod:`onnx_export`: its class scores are the ``probabilities`` output, and a window closes every
    ``window_count`` predictions; the input ranges come from ``reference_rows`` held-out rows (None: the
    first window's); with ``holdout_accuracy`` (the bundle carries a labelled reference) a rule on the
    estimated accuracy. No bad-input rule where so many columns against so few rows could not tell."""
    bad_over = bad_input_over(columns, reference_rows or window_count, window_count)
    rules = [{"name": "input-drift", "signal": "drift", "over": DRIFT_OVER, "for": 2}]
    if bad_over is not None:
        rules.append({"name": "bad-input", "signal": "data_quality", "over": bad_over})
    if holdout_accuracy is not None:
        rules.append({"name": "accuracy-low", "signal": "mpp", "under": round(max(0.0, holdout_accuracy - ACCURACY_DROP), 4),
                      "for": 3, "clear_after": 3})
    return yaml.safe_dump({"task": "multiclass", "outputs": {"scores": "probabilities"},
                           "window": {"count": window_count}, "rules": rules}, sort_keys=False)
