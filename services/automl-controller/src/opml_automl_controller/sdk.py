"""The Push collector's SDK: what a trial calls to report its metrics (Katib's ``report_metrics``).

    from opml_automl_controller.sdk import report
    report(loss=0.31, accuracy=0.88)

Each call writes one line to stdout, which reaches the controller through the job's log stream
(so a trial needs no credentials nor a network path to the controller). Only this module's
lines count under ``collector.kind: Push``; anything else the trial prints is ignored.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import TextIO

from opml_automl_controller.collect import MODEL_MARKER, PUSH_MARKER


def report(*, stream: TextIO | None = None, **metrics: float) -> None:
    """Report one observation of each metric given (finite numbers).

    Raises:
        ValueError: no metric given, or a value is not a finite number.
    """
    if not metrics:
        raise ValueError("report() needs at least one metric, e.g. report(loss=0.3)")
    for name, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"metric {name!r} must be a finite number, but got {value!r}")
    out = stream or sys.stdout
    out.write(PUSH_MARKER + json.dumps({"metrics": {k: float(v) for k, v in metrics.items()}}) + "\n")
    out.flush()


def save_model(path: str | Path, *, stream: TextIO | None = None) -> None:
    """Say where this trial saved its model (a directory): if the trial is the experiment's best,
    the controller commits it as a bundle.

    Raises:
        ValueError: ``path`` is not an existing directory.
    """
    directory = Path(path).resolve()
    if not directory.is_dir():
        raise ValueError(f"save_model() needs an existing directory, but got {str(path)!r}")
    out = stream or sys.stdout
    out.write(MODEL_MARKER + json.dumps({"path": str(directory)}) + "\n")
    out.flush()
