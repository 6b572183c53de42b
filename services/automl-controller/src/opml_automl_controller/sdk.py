"""The Push collector's SDK: what a trial calls to report its metrics (Katib's ``report_metrics``).

    from opml_automl_controller.sdk import report
    report(loss=0.31, accuracy=0.88)

Each call writes one line to stdout, which reaches the controller through the job's log stream
(so a trial needs no credentials nor a network path to the controller). Only this module's
lines count under ``collector.kind: Push``; anything else the trial prints is ignored.

A trial of an experiment that asks for a model (``spec.model``) uploads it itself, with the upload
grant the controller put in its job (a token for its own bundle and nothing else):

    from opml_automl_controller.sdk import model_dir, save_model
    export_onnx(model, model_dir() / "model.onnx")          # and model.yaml beside it, to be served
    save_model(model_dir(), reference={"features": {"x0": x_val[:, 0], "x1": x_val[:, 1]},
                                       "predicted": y_hat, "scores": p_hat, "labels": y_val})

The folder's files go to the bundle's root (``model.onnx``, ``model.yaml``...), and ``reference``
becomes its ``reference.npz`` (the monitoring-scorer's format), so the model is monitored from its
first window once it serves. The controller reads the uploaded bundle back from the bundle-store
when the experiment ends, and commits the best one.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from opml_automl_controller.collect import MODEL_MARKER, PUSH_MARKER
from opml_automl_controller.trialmodel import MODEL_DIR_VARIABLE
from opml_automl_controller.uploadenv import (
    BUNDLE_VARIABLE,
    CONTEXT_VARIABLE,
    GRANT_VARIABLE,
    MAX_BYTES_VARIABLE,
    TARGET_VARIABLE,
)


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


MAX_MODEL_FILES = 10_000
"""Files a model may hold (each one a message of the upload)."""
REFERENCE_FILE = "reference.npz"


def save_model(path: str | Path, *, reference: Mapping[str, Any] | None = None,
               stream: TextIO | None = None) -> str:
    """Upload this trial's model to the bundle-store with the trial's upload grant: the files of the
    folder ``path`` at the bundle's root, keeping their layout below it (or the one file ``path``), and
    ``reference`` as ``reference.npz``. If the trial is the experiment's best, the controller commits
    it (the trial's own version stays uncommitted: nothing serves or monitors it). Returns the uploaded
    bundle's uuid, and says it in the log (one marked line).

    ``reference``: the keyword arguments of the monitoring-scorer's ``reference_npz``: ``features``
    (name -> one value per row), ``predicted`` (the model's output per row), optional ``scores`` and
    ``labels`` (the truth): a few thousand validation rows.

    Raises:
        ValueError: the experiment asks for no model (no grant here); ``path`` is no file or folder, holds
            a symlink or something else than files and folders, more than :data:`MAX_MODEL_FILES` files, or
            more bytes than the grant allows; ``reference`` breaks the reference set's rules, or the
            folder holds a ``reference.npz`` too.
        OpmlError: the bundle-store refused the upload (a grant that expired: PERMISSION_DENIED or
            UNAUTHENTICATED, with the reason).
    """
    from opml_bundle_store_contract.client import BundleStoreClient  # a trial that only reports needs no gRPC

    target, grant = os.environ.get(TARGET_VARIABLE), os.environ.get(GRANT_VARIABLE)
    context, bundle = os.environ.get(CONTEXT_VARIABLE), os.environ.get(BUNDLE_VARIABLE)
    if not (target and grant and context and bundle):
        raise ValueError(f"save_model() needs the upload grant the automl-controller gives the trials of an "
                         f"experiment with spec.model ({GRANT_VARIABLE} and {TARGET_VARIABLE} are not set)")
    max_bytes = int(os.environ.get(MAX_BYTES_VARIABLE) or 0)
    files: dict[str, Path | bytes] = dict(_model_files(Path(path)))
    if reference is not None:
        if REFERENCE_FILE in files:
            raise ValueError(f"save_model() was given a reference set and {str(path)!r} holds a {REFERENCE_FILE} "
                             f"too; give one of them")
        from opml_monitoring_scorer_contract.reference import reference_npz  # numpy: only with a reference

        files[REFERENCE_FILE] = reference_npz(**reference)
    size = sum(len(f) if isinstance(f, bytes) else f.stat().st_size for f in files.values())
    if max_bytes and size > max_bytes:
        raise ValueError(f"the model holds {size} bytes, more than the {max_bytes} the experiment allows "
                         f"(spec.model.maxBytes)")
    with BundleStoreClient(target, token=grant) as client:
        uploaded = client.add(context, bundle, files, tags={"kind": "trial-model"})  # the controller commits
    out = stream or sys.stdout
    out.write(MODEL_MARKER + json.dumps({"bundle": uploaded.bundle_name, "uuid": uploaded.uuid}) + "\n")
    out.flush()
    return uploaded.uuid


def _model_files(path: Path) -> list[tuple[str, Path]]:
    """Bundle path -> file: a folder's files relative to it (not under its name), a file by its name;
    walked without following symlinks, and bounded."""
    if path.is_symlink() or not (path.is_dir() or path.is_file()):
        raise ValueError(f"save_model() needs a folder or a file, but {str(path)!r} is neither (or a symlink)")
    if path.is_file():
        return [(path.name, path)]
    found = []
    for folder, dirs, names in os.walk(path):
        for name in sorted(dirs + names):
            entry = Path(folder) / name
            if entry.is_symlink() or not (entry.is_dir() or entry.is_file()):
                raise ValueError(f"the model holds {str(entry)!r}, which is not a file or a folder (a symlink?)")
            if entry.is_file():
                found.append((entry.relative_to(path).as_posix(), entry))
        if len(found) > MAX_MODEL_FILES:
            raise ValueError(f"the model holds more than {MAX_MODEL_FILES} files")
    if not found:
        raise ValueError(f"the model folder {str(path)!r} holds no file")
    return sorted(found)
