"""The Push collector's SDK: what a trial calls to report its metrics (Katib's ``report_metrics``).

    from opml_automl_controller.sdk import report
    report(loss=0.31, accuracy=0.88)

Each call writes one line to stdout, which reaches the controller through the job's log stream
(so a trial needs no credentials nor a network path to the controller). Only this module's
lines count under ``collector.kind: Push``; anything else the trial prints is ignored.

A trial that saves a model writes it in its own model folder, ``$AUTOML_MODEL_DIR``, and says so:

    from opml_automl_controller.sdk import model_dir, save_model
    model.save(model_dir() / "model.keras")
    save_model()  # the whole folder; or save_model("sub/folder")
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import TextIO

from opml_automl_controller.collect import MODEL_MARKER, PUSH_MARKER
from opml_automl_controller.trialmodel import MODEL_DIR_VARIABLE


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


def model_dir() -> Path:
    """This trial's own model folder (the controller names one per trial in the job's
    ``AUTOML_MODEL_DIR``): only a model saved in it can be committed. It is the job's checkpoint
    folder, which a sandboxed job finds made for its user; a job the orchestrator runs unsandboxed (as
    the controller's user) is given no folder, so it is made here (mode 0700) when it is not there.

    Raises:
        ValueError: the variable is not set (not a trial of the automl-controller).
        OSError: the folder is not there and cannot be made.
    """
    folder = os.environ.get(MODEL_DIR_VARIABLE)
    if not folder:
        raise ValueError(f"{MODEL_DIR_VARIABLE} is not set: the automl-controller sets it in each trial's job")
    path = Path(folder)
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def save_model(path: str | Path = ".", *, stream: TextIO | None = None) -> None:
    """Say where this trial saved its model: a directory (or file) inside :func:`model_dir`, the whole
    folder by default; if the trial is the experiment's best, the controller commits it as a bundle.

    Raises:
        ValueError: not a trial (:func:`model_dir`), or ``path`` is not an existing directory or file
            inside the trial's model folder.
    """
    folder = model_dir().resolve()
    target = (folder / path).resolve()
    if not target.is_relative_to(folder) or not target.exists():
        raise ValueError(f"save_model() needs a directory or file inside this trial's model folder "
                         f"({MODEL_DIR_VARIABLE}={str(folder)!r}), but got {str(path)!r}")
    out = stream or sys.stdout
    out.write(MODEL_MARKER + json.dumps({"path": target.relative_to(folder).as_posix()}) + "\n")
    out.flush()
