"""The data-step program the pipeline engine runs as a sandboxed job::

    python -m opml_job_orchestrator.pipelines.stepjobs validate|evaluate --step STEP_JSON --inputs DIR --outputs DIR

It reads only its input folders and writes only its output folder (no network). Exit 0 when the step
ran, whatever it found (anomalies, no blessing: that is ``result.json``); exit 2 with one line on
stderr, ``<command>: <error name>: <what is wrong>``, when the inputs are unusable. Every file is
written to a temporary name and renamed, ``result.json`` last, so a killed step leaves no half file
and a folder with ``result.json`` is complete.

validate
    inputs: ``spans/<span>/*.csv`` (spans with no statistics yet), ``statistics/<span>/statistics.json``
    (spans computed before: never recomputed), ``schema/schema.json`` (optional).
    step: ``{"spans": [oldest .. newest], "label": column | null, "thresholds": {...}}``.
    outputs: ``statistics/<span>/statistics.json`` per span computed now, ``schema/schema.json`` when
    none was given (inferred from the first span), ``result.json``:
    ``{"ok", "anomalies": [...], "computed": [spans], "schema_inferred", "span", "previous_span"}``.

evaluate
    inputs: ``candidate/`` and ``baseline/`` (absent on the first run), each ``model.onnx`` +
    ``model.yaml``; ``span/*.csv`` (the newest labelled span).
    step: :mod:`~opml_job_orchestrator.pipelines.evaluation`'s config.
    outputs: ``result.json`` (``blessed``, ``baseline``, ``reference``, ``reasons``, ``metrics``), and
    ``reference/reference.npz`` + ``reference/monitoring.yaml`` for the monitoring-scorer (from 100 rows);
    the reference carries each slice column's values (``segment.<column>``), so a model pushed with
    ``monitoring: {segment: <column>}`` is judged per value against that value's own rows.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from opml_job_orchestrator.pipelines import anomalies, evaluation, schema, statistics
from opml_job_orchestrator.pipelines.table import Table, TableError, numeric_matrix, read_span
from opml_monitoring_scorer_contract.reference import MAX_SEGMENT_COLUMNS, MAX_SEGMENT_VALUE_CHARS, bad_input_over

MAX_STEP_BYTES = 1 << 20
"""Largest step.json read (1 MiB)."""
MAX_STATISTICS_BYTES = 64 << 20
"""Largest statistics.json read (64 MiB: 1,000 columns with 1,000 top values each fit)."""
MAX_SCHEMA_BYTES = 64 << 20
"""Largest schema.json read (domains come from the kept values: at most 32 KiB of text a column)."""
MAX_MODEL_BYTES = 2 << 30
"""Largest model.onnx run (2 GiB, protobuf's own limit)."""
MAX_SPANS = 1_000
"""Most spans one validate step names."""
MAX_REFERENCE_ROWS = 10_000
"""Most rows of the reference set written for the monitoring-scorer (a seeded sample beyond)."""
MIN_REFERENCE_ROWS = 100
"""Fewest rows of a reference set the monitoring-scorer accepts (fewer: none is written, and the result says so)."""
BATCH_ROWS = 4_096
"""Rows per onnxruntime call."""
WINDOW_COUNT = 1_000
"""Predictions per monitoring window in the monitoring.yaml written."""
QUALITY_MARGIN = 0.05
"""How far below its validation accuracy (above its MAE, as a share) a model may fall before alerting: below
the lowest of its accuracy overall and on each slice judged (a version monitored per slice value checks
each value's windows with the same rule, and a line the model was validated at 0.80 on is no worse than
validated when the lines together were at 0.85)."""
DRIFT_OVER = 0.3
"""Drift distance of any input column from the reference that alerts, two windows running."""
SPAN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_NUMPY_TYPES = {"fp32": np.float32, "fp64": np.float64, "int32": np.int32, "int64": np.int64}
_VALIDATE_KEYS = {"spans", "label", "thresholds"}


class StepError(Exception):
    """The step's inputs are unusable; ``name`` is the error's stable name (``label_missing``...)."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name = name
        self.message = message


# ----------------------------------------------------------------------------------------------
# Files


def read_json(path: Path, limit: int, what: str, error: str) -> Any:
    """The JSON document at ``path``, read within ``limit`` bytes.

    Raises:
        StepError(``error``): absent, too large, or not JSON.
    """
    try:
        with path.open("rb") as file:
            data = file.read(limit + 1)
    except OSError as exc:
        raise StepError(error, f"{what} {path} cannot be read: {exc.strerror}") from None
    if len(data) > limit:
        raise StepError(error, f"{what} {path} is larger than {limit} bytes")
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise StepError(error, f"{what} {path} is not JSON: {exc}") from None


def write_atomically(path: Path, write: Callable[[Any], None], *, binary: bool = False) -> None:
    """Writes ``path`` through ``write(file)`` into a temporary file of its folder, then renames it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "wb" if binary else "w") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def write_json(path: Path, document: Any) -> None:
    """``document`` as strict JSON (a non-finite float, an overflowed std, becomes null)."""
    write_atomically(path, lambda file: json.dump(_finite(document), file, indent=1, allow_nan=False))


def _span(directory: Path, keep_text: Collection[str] = ()) -> Table:
    try:
        return read_span(directory, keep_text=keep_text)
    except TableError as error:
        raise StepError("span_unreadable", str(error)) from None


# ----------------------------------------------------------------------------------------------
# validate


def validate_step_errors(step: Any) -> list[str]:
    """Every rule a validate step.json breaks, with its path."""
    if not isinstance(step, Mapping):
        return [f"step: must be an object, but got {type(step).__name__}"]
    problems = [f"step.{key}: is not a setting; the settings are {', '.join(sorted(_VALIDATE_KEYS))}"
                for key in step if key not in _VALIDATE_KEYS]
    spans = step.get("spans")
    if not isinstance(spans, list) or not spans or len(spans) > MAX_SPANS:
        problems.append(f"step.spans: must be a list of 1 to {MAX_SPANS} span ids, oldest first")
    else:
        for index, span in enumerate(spans):
            if not isinstance(span, str) or not SPAN_ID.match(span) or span in (".", ".."):
                problems.append(f"step.spans[{index}]: must match {SPAN_ID.pattern}, but got {span!r}")
        if len(set(map(str, spans))) != len(spans):
            problems.append("step.spans: a span appears twice")
    label = step.get("label")
    if label is not None and not (isinstance(label, str) and label):
        problems.append(f"step.label: must be a column name or null, but got {label!r}")
    return problems + anomalies.threshold_errors(step.get("thresholds"), "step.thresholds")


def run_validate(step: Any, inputs: Path, outputs: Path) -> dict[str, Any]:
    problems = validate_step_errors(step)
    if problems:
        raise StepError("step_invalid", "; ".join(problems))
    thresholds = anomalies.parse_thresholds(step.get("thresholds"), "step.thresholds")
    spans: list[str] = step["spans"]
    given = {span: inputs / "statistics" / span / "statistics.json" for span in spans}
    raw = {span: inputs / "spans" / span for span in spans}
    absent = [span for span in spans if not given[span].is_file() and not raw[span].is_dir()]
    if absent:
        raise StepError("span_missing", f"spans {absent} have neither statistics/<span>/statistics.json "
                                        "nor spans/<span>/ in the inputs")
    schema_path = inputs / "schema" / "schema.json"
    current_schema = None
    if schema_path.is_file():
        try:
            current_schema = schema.check(read_json(schema_path, MAX_SCHEMA_BYTES, "schema", "schema_invalid"))
        except schema.SchemaError as error:
            raise StepError("schema_invalid", str(error)) from None

    stats: dict[str, dict[str, Any]] = {}
    computed: list[str] = []

    def statistics_of(span: str) -> dict[str, Any]:
        if given[span].is_file():
            try:
                return statistics.check(read_json(given[span], MAX_STATISTICS_BYTES, "statistics",
                                                  "statistics_invalid"), f"statistics of span {span}")
            except statistics.StatisticsError as error:
                raise StepError("statistics_invalid", str(error)) from None
        computed.append(span)
        return statistics.compute(_span(raw[span], statistics.text_columns(current_schema)), current_schema)

    schema_inferred = current_schema is None
    if current_schema is None:
        stats[spans[0]] = statistics_of(spans[0])
        current_schema = schema.infer(stats[spans[0]], span=spans[0])
    for span in spans:
        if span not in stats:
            stats[span] = statistics_of(span)

    newest = spans[-1]
    previous = spans[-2] if len(spans) > 1 else None
    found = anomalies.find(stats[newest], current_schema, stats[previous] if previous else None, thresholds,
                           label=step.get("label"))
    for span in computed:
        write_json(outputs / "statistics" / span / "statistics.json", stats[span])
    if schema_inferred:
        write_json(outputs / "schema" / "schema.json", current_schema)
    result = {"ok": not found, "anomalies": [a.to_dict() for a in found], "computed": computed,
              "schema_inferred": schema_inferred, "span": newest, "previous_span": previous}
    write_json(outputs / "result.json", result)
    return result


# ----------------------------------------------------------------------------------------------
# evaluate


class _Model:
    """A model folder's config and onnxruntime session (onnxruntime imported on first use)."""

    def __init__(self, folder: Path, what: str) -> None:
        from opml_common.errors import OpmlError
        from opml_inference_router_contract.model_config import load_model_config

        try:
            self.config = load_model_config(folder / "model.yaml")
        except OpmlError as error:
            raise StepError("model_invalid", f"{what} model.yaml: {error.message}") from None
        onnx_path = folder / "model.onnx"
        if not onnx_path.is_file():
            raise StepError("model_invalid", f"{what} has no model.onnx")
        if onnx_path.stat().st_size > MAX_MODEL_BYTES:
            raise StepError("model_invalid", f"{what} model.onnx is larger than {MAX_MODEL_BYTES} bytes")
        self.path, self.what = onnx_path, what

    @property
    def signature(self) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        """What a caller feeds the model: its inputs' names, element types and dims."""
        return tuple((t.name, t.data_type, tuple(t.dims)) for t in self.config.inputs)

    def output_spec(self, name: str | None) -> Any:
        for tensor in self.config.outputs:
            if name is None or tensor.name == name:
                return tensor
        names = [t.name for t in self.config.outputs]
        raise StepError("model_invalid", f"{self.what} has no output {name!r}; its outputs: {names}")

    def check_input(self, features: int) -> None:
        problems = []
        if len(self.config.inputs) != 1:
            problems.append(f"evaluate feeds one [batch, features] input, but the model has {len(self.config.inputs)}")
        else:
            tensor = self.config.inputs[0]
            if tensor.data_type not in _NUMPY_TYPES:
                problems.append(f"input {tensor.name!r} is {tensor.data_type}; evaluate feeds {', '.join(_NUMPY_TYPES)}")
            if not tensor.dims or tensor.dims[-1] not in (features, -1):
                problems.append(f"input {tensor.name!r} has dims {list(tensor.dims)}, the step names {features} "
                                "features")
        if self.config.max_batch_size < 1:
            problems.append("evaluate runs batches: the model needs max_batch_size >= 1")
        if problems:
            raise StepError("model_invalid", f"{self.what}: " + "; ".join(problems))

    def run(self, matrix: np.ndarray, output: str) -> np.ndarray:
        """The model's ``output`` on every row of ``matrix``.

        Raises:
            StepError(model_failed): onnxruntime refused the model or failed on the rows.
        """
        import onnxruntime

        tensor = self.config.inputs[0]
        try:
            session = onnxruntime.InferenceSession(str(self.path), providers=["CPUExecutionProvider"])
            batch_dim = session.get_inputs()[0].shape[0]
            step = BATCH_ROWS if not isinstance(batch_dim, int) else max(1, batch_dim)
            feed = matrix.astype(_NUMPY_TYPES[tensor.data_type])
            parts = [session.run([output], {tensor.name: feed[start:start + step]})[0]
                     for start in range(0, len(feed), step)]
        except Exception as error:  # onnxruntime raises its own untyped errors
            raise StepError("model_failed", f"{self.what}: onnxruntime: {str(error)[:500]}") from None
        result = np.concatenate(parts) if parts else np.empty((0,))
        if len(result) != len(matrix):
            raise StepError("model_failed", f"{self.what}: output {output!r} has {len(result)} rows for "
                                            f"{len(matrix)} inputs")
        return result


def _task(config: evaluation.EvalConfig, output: Any) -> str:
    if config.task is not None:
        return config.task
    width = output.dims[-1] if output.dims else 1
    return "regression" if width in (1, -1) else ("binary" if width == 2 else "multiclass")


def run_evaluate(step: Any, inputs: Path, outputs: Path) -> dict[str, Any]:
    try:
        config = evaluation.parse_config(step, "step")
    except evaluation.EvaluationError as error:
        raise StepError("step_invalid", str(error)) from None
    if not (inputs / "span").is_dir():
        raise StepError("span_missing", "the inputs have no span/ folder")
    table = _span(inputs / "span", keep_text=config.slices)
    label = table.columns.get(config.label)
    if label is None or label.type is None:
        raise StepError("label_missing", f"span has no {'value in its ' if label else ''}label column "
                                         f"{config.label!r}")
    if label.numbers is None:
        raise StepError("label_invalid", f"label column {config.label!r} holds {label.type} values, not numbers")
    missing_slices = [c for c in config.slices if c not in table.columns]
    try:
        matrix, usable = numeric_matrix(table, config.features)
    except TableError as error:
        raise StepError("features_invalid", str(error)) from None
    if missing_slices:
        raise StepError("features_invalid", f"slice columns {missing_slices} are not in the span")

    candidate = _Model(inputs / "candidate", "candidate")
    candidate.check_input(len(config.features))
    output = candidate.output_spec(config.output)
    task = _task(config, output)
    wrong = [m for m in config.metrics if m not in evaluation.task_metrics(task)]
    if wrong:
        raise StepError("step_invalid", f"step.metrics: {wrong} are not defined for a {task} model "
                                        f"(its metrics: {', '.join(evaluation.task_metrics(task))})")
    rows = usable & np.isfinite(label.numbers)
    if not rows.any():
        raise StepError("label_missing", f"no row of the span has a label in {config.label!r} and every feature")
    labels = label.numbers[rows]
    features = matrix[rows]
    predictions = candidate.run(features, output.name)
    if task != "regression":
        classes = evaluation.class_scores(predictions).shape[1]
        bad = ~np.isin(labels, np.arange(classes))
        if bad.any():
            raise StepError("label_invalid", f"{int(bad.sum())} labels of {config.label!r} are not class indices "
                                             f"0..{classes - 1} (first: {labels[bad][0]!r})")
    sliced = {c: [v for v, keep in zip(table.columns[c].text, rows, strict=True) if keep] for c in config.slices}
    slices, notes = evaluation.slice_masks(sliced)
    metrics: dict[str, Any] = {"candidate": evaluation.sliced_metrics(task, config.metrics, labels, predictions, slices)}

    baseline_metrics, why = _baseline(inputs / "baseline", candidate, config, task, features, labels, slices)
    if baseline_metrics is not None:
        metrics["baseline"] = baseline_metrics
    blessed, reasons = evaluation.judge(config, metrics["candidate"], baseline_metrics, no_baseline_why=why)
    reason_dicts = [r.to_dict() for r in reasons]
    reason_dicts += [{"metric": None, "slice": None, "value": None, "threshold": None, "baseline_value": None,
                      "passed": None, "message": note} for note in notes]
    if why is not None:
        reason_dicts.insert(0, {"metric": None, "slice": None, "value": None, "threshold": None,
                                "baseline_value": None, "passed": None, "message": why})

    reference = len(labels) >= MIN_REFERENCE_ROWS
    if reference:
        _write_reference(outputs / "reference", config, task, candidate, output.name, features, labels, predictions,
                         _judged(metrics["candidate"], config.min_rows), sliced)
    else:
        reason_dicts.append({"metric": None, "slice": None, "value": None, "threshold": None, "baseline_value": None,
                             "passed": None, "message": f"no reference set written: {len(labels)} rows, the "
                                                        f"monitoring-scorer needs {MIN_REFERENCE_ROWS}"})
    reason_dicts.sort(key=lambda r: r["passed"] is not False)  # the failed checks first: why, at a glance
    result = {"blessed": blessed, "baseline": baseline_metrics is not None, "reference": reference, "task": task,
              "rows": int(rows.sum()), "rows_skipped": int(table.rows - rows.sum()),
              "reasons": reason_dicts, "metrics": metrics}
    write_json(outputs / "result.json", result)
    return result


def _baseline(folder: Path, candidate: _Model, config: evaluation.EvalConfig, task: str, features: np.ndarray,
              labels: np.ndarray, slices: Mapping[str, np.ndarray]) -> tuple[dict[str, Any] | None, str | None]:
    """The baseline's metrics on the same rows, or None and why not."""
    if not folder.is_dir() or not any(folder.iterdir()):
        return None, "no baseline: the first run is judged on value thresholds only"
    try:
        baseline = _Model(folder, "baseline")
        if baseline.signature != candidate.signature:
            return None, (f"baseline comparison skipped: the candidate's input signature "
                          f"{_show(candidate.signature)} differs from the baseline's {_show(baseline.signature)}; "
                          "judged on value thresholds only")
        predictions = baseline.run(features, baseline.output_spec(config.output).name)
    except StepError as error:
        # The blessed model no longer runs (a runtime it was made for is gone): the candidate is still
        # judged, on its own values, rather than every later candidate failing on the baseline.
        return None, f"baseline comparison skipped: {error.message}; judged on value thresholds only"
    return evaluation.sliced_metrics(task, config.metrics, labels, predictions, slices), None


def _show(signature: tuple[tuple[str, str, tuple[int, ...]], ...]) -> str:
    return ", ".join(f"{name}:{kind}{list(dims)}" for name, kind, dims in signature)


def _finite(value: Any) -> Any:
    """``value`` with non-finite floats as None (strict JSON has no NaN or infinity)."""
    if isinstance(value, float):
        return value if np.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _judged(candidate: Mapping[str, Mapping[str, Any]], min_rows: int) -> list[Mapping[str, Any]]:
    """The candidate's metrics overall, then on each slice of at least ``min_rows`` rows (the ones judged)."""
    return [candidate[evaluation.OVERALL]] + [values for key, values in candidate.items()
                                             if key != evaluation.OVERALL and values.get("rows", 0) >= min_rows]


def _write_reference(folder: Path, config: evaluation.EvalConfig, task: str, model: _Model, output: str,
                     features: np.ndarray, labels: np.ndarray, predictions: np.ndarray,
                     judged: list[Mapping[str, Any]], sliced: Mapping[str, list[str | None]]) -> None:
    """The monitoring-scorer's reference set (its README's ``reference.npz``: feature columns, the
    model's outputs on them, labels, and each slice column's values as ``segment.<column>``: a
    missing value is "", in no segment; a column with a value over the scorer's
    ``MAX_SEGMENT_VALUE_CHARS`` is left out, as no request parameter of it makes a segment of its
    own) and a ``monitoring.yaml`` with default rules (``judged``: the metrics overall and per slice
    judged, whose worst sets the quality rule's bound)."""
    keep = np.arange(len(labels))
    if len(keep) > MAX_REFERENCE_ROWS:
        keep = np.sort(np.random.default_rng(0).choice(len(keep), MAX_REFERENCE_ROWS, replace=False))
    arrays: dict[str, np.ndarray] = {f"feature.{name}": features[keep, i].astype(np.float64)
                                     for i, name in enumerate(config.features)}
    if task == "regression":
        arrays["predicted"] = predictions[keep].reshape(len(keep)).astype(np.float64)
        arrays["labels"] = labels[keep].astype(np.float64)
    else:
        scores = evaluation.class_scores(predictions[keep])
        arrays["predicted"] = scores.argmax(axis=1).astype(np.int64)
        arrays["scores"] = np.asarray(predictions[keep], dtype=np.float32)
        arrays["labels"] = labels[keep].astype(np.int64)
    for column, values in list(sliced.items())[:MAX_SEGMENT_COLUMNS]:
        text = np.array(["" if v is None else v for v in values], dtype=str)[keep]
        if not len(text) or int(np.char.str_len(text).max()) <= MAX_SEGMENT_VALUE_CHARS:
            arrays[f"segment.{column}"] = text
    write_atomically(folder / "reference.npz", lambda file: np.savez_compressed(file, **arrays), binary=True)

    input_name = model.config.inputs[0].name
    monitoring: dict[str, Any] = {"task": task, "features": {input_name: list(config.features)}}
    if task == "regression":
        monitoring["outputs"] = {"predicted": output}
        errors = [m["mae"] for m in judged if m.get("mae") is not None]
        quality = {"name": "error-high", "signal": "mpp", "over": round(max(errors) * (1 + QUALITY_MARGIN), 6),
                   "for": 3} if errors else None
    else:
        monitoring["outputs"] = {"scores": output}
        accuracies = [m["accuracy"] if m.get("accuracy") is not None else 1.0 - m["error_rate"]
                      for m in judged if m.get("accuracy") is not None or m.get("error_rate") is not None]
        accuracy = min(accuracies) if accuracies else None
        quality = {"name": "accuracy-low", "signal": "mpp", "under": round(max(0.0, accuracy - QUALITY_MARGIN), 6),
                   "for": 3} if accuracy is not None else None
    monitoring["window"] = {"count": WINDOW_COUNT}
    bad_over = bad_input_over(len(config.features), len(keep), WINDOW_COUNT)
    monitoring["rules"] = [rule for rule in (
        quality,
        {"name": "input-drift", "signal": "drift", "over": DRIFT_OVER, "for": 2},
        {"name": "bad-input", "signal": "data_quality", "over": bad_over} if bad_over is not None else None,
    ) if rule is not None]
    write_atomically(folder / "monitoring.yaml", lambda file: yaml.safe_dump(monitoring, file, sort_keys=False))


def monitoring_with_segment(monitoring: bytes | None, parameter: str) -> bytes:
    """The monitoring.yaml (``monitoring``: the evaluate step's; None: none was written) with
    ``segment: {parameter: ...}``, so the monitoring-scorer monitors each value of that request
    parameter apart (the push step's ``monitoring.segment``)."""
    document = yaml.safe_load(monitoring) if monitoring else None
    document = document if isinstance(document, dict) else {}
    document["segment"] = {"parameter": parameter}
    return yaml.safe_dump(document, sort_keys=False).encode()


# ----------------------------------------------------------------------------------------------
# Entry point


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opml_job_orchestrator.pipelines.stepjobs",
                                     description="A pipeline's data step: validate spans or evaluate a model.")
    parser.add_argument("command", choices=("validate", "evaluate"))
    parser.add_argument("--step", type=Path, required=True, help="the step's JSON config")
    parser.add_argument("--inputs", type=Path, required=True, help="folder of the step's inputs")
    parser.add_argument("--outputs", type=Path, required=True, help="folder the step writes")
    args = parser.parse_args(argv)
    try:
        step = read_json(args.step, MAX_STEP_BYTES, "step", "step_invalid")
        run = run_validate if args.command == "validate" else run_evaluate
        run(step, args.inputs, args.outputs)
    except StepError as error:
        print(f"{args.command}: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
