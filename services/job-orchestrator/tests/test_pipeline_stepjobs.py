"""The step program as the engine runs it: ``python -m opml_job_orchestrator.pipelines.stepjobs`` in a
subprocess over temporary folders, for validate (a first span infers the schema; a second with a
missing column, a NaN flood and a drifted column names each anomaly) and evaluate (hand-built ONNX
models: a first run without baseline, a worse candidate refused by a change threshold, a baseline
with another input signature skipped, a span without labels refused)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from opml_job_orchestrator.pipelines.stepjobs import write_atomically

PROGRAM = "opml_job_orchestrator.pipelines.stepjobs"


def _run(command: str, step: dict[str, Any], inputs: Path, outputs: Path) -> subprocess.CompletedProcess[str]:
    step_file = inputs.parent / f"step-{command}.json"
    step_file.write_text(json.dumps(step))
    return subprocess.run([sys.executable, "-m", PROGRAM, command, "--step", str(step_file), "--inputs", str(inputs),
                           "--outputs", str(outputs)], capture_output=True, text=True, timeout=120, check=False)


def _write_span(folder: Path, columns: dict[str, list[Any]], files: int = 1) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    names = list(columns)
    rows = list(zip(*columns.values(), strict=True))
    for part in range(files):
        lines = [",".join(names)] + [",".join("" if v is None else str(v) for v in row) for row in rows[part::files]]
        (folder / f"part-{part}.csv").write_text("\n".join(lines) + "\n")


def _columns(rows: int, seed: int) -> dict[str, list[Any]]:
    rng = np.random.default_rng(seed)
    a, b = rng.normal(size=rows), rng.normal(size=rows)
    return {"a": [f"{v:.5f}" for v in a], "b": [f"{v:.5f}" for v in b],
            "color": [["red", "green", "blue"][i % 3] for i in range(rows)],
            "line": [["l1", "l2"][i % 2] if i < rows - 5 else "l3" for i in range(rows)],
            "y": [int(v > 0) for v in a]}


def _result(outputs: Path) -> dict[str, Any]:
    return json.loads((outputs / "result.json").read_text())


# ----------------------------------------------------------------------------------------------
# validate


def test_validate_infers_the_schema_then_names_each_anomaly_of_a_later_span(tmp_path: Path) -> None:
    first_in, first_out = tmp_path / "run1" / "inputs", tmp_path / "run1" / "outputs"
    _write_span(first_in / "spans" / "2026-12-01", _columns(600, seed=1), files=2)
    done = _run("validate", {"spans": ["2026-12-01"], "label": "y"}, first_in, first_out)
    assert done.returncode == 0, done.stderr
    result = _result(first_out)
    assert result == {"ok": True, "anomalies": [], "computed": ["2026-12-01"], "schema_inferred": True,
                      "span": "2026-12-01", "previous_span": None}
    inferred = json.loads((first_out / "schema" / "schema.json").read_text())
    assert inferred["features"]["color"]["domain"] == ["blue", "green", "red"]
    assert inferred["features"]["a"]["type"] == "float" and inferred["features"]["a"]["required"] is True
    first_stats = first_out / "statistics" / "2026-12-01" / "statistics.json"
    assert json.loads(first_stats.read_text())["num_examples"] == 600

    # the next run: the first span's statistics and the schema are inputs (never recomputed)
    second_in, second_out = tmp_path / "run2" / "inputs", tmp_path / "run2" / "outputs"
    (second_in / "statistics" / "2026-12-01").mkdir(parents=True)
    (second_in / "statistics" / "2026-12-01" / "statistics.json").write_text(first_stats.read_text())
    (second_in / "schema").mkdir(parents=True)
    (second_in / "schema" / "schema.json").write_text((first_out / "schema" / "schema.json").read_text())
    later = _columns(600, seed=2)
    del later["color"]                                                   # a missing column
    later["a"] = ["nan"] * 300 + later["a"][300:]                          # a NaN flood
    later["b"] = [f"{float(v) + 3.0:.5f}" for v in later["b"]]            # a drifted numeric column
    _write_span(second_in / "spans" / "2026-12-02", later)
    done = _run("validate", {"spans": ["2026-12-01", "2026-12-02"], "label": "y",
                             "thresholds": {"features": {"b": {"jensen_shannon_divergence": 0.2}}}},
                second_in, second_out)
    assert done.returncode == 0, done.stderr
    result = _result(second_out)
    assert result["ok"] is False and result["computed"] == ["2026-12-02"] and result["schema_inferred"] is False
    assert result["previous_span"] == "2026-12-01"
    found = {(a["feature"], a["statistic"]): a for a in result["anomalies"]}
    assert set(found) == {("color", "column"), ("a", "nan_share"), ("b", "jensen_shannon_divergence")}
    assert found[("a", "nan_share")]["value"] == 0.5 and found[("a", "nan_share")]["threshold"] == 0.01
    assert found[("b", "jensen_shannon_divergence")]["threshold"] == 0.2
    assert found[("b", "jensen_shannon_divergence")]["value"] > 0.5
    assert "not in the span" in found[("color", "column")]["message"]
    assert not (second_out / "statistics" / "2026-12-01").exists(), "a span's statistics are computed once"
    assert not (second_out / "schema").exists()
    assert sorted(p.name for p in (second_out / "statistics" / "2026-12-02").iterdir()) == ["statistics.json"]


def test_validate_refuses_unusable_inputs_with_a_named_error(tmp_path: Path) -> None:
    inputs, outputs = tmp_path / "inputs", tmp_path / "outputs"
    inputs.mkdir()
    done = _run("validate", {"spans": ["s1"], "thresholds": {"default": {"nan_share": 5}, "features": []}},
                inputs, outputs)
    assert done.returncode == 2
    assert done.stderr.startswith("validate: step_invalid: ")
    assert "step.thresholds.default.nan_share" in done.stderr and "step.thresholds.features" in done.stderr
    done = _run("validate", {"spans": ["s1", "s2"]}, inputs, outputs)
    assert done.returncode == 2 and "span_missing: spans ['s1', 's2']" in done.stderr
    (inputs / "spans" / "s1").mkdir(parents=True)
    (inputs / "spans" / "s1" / "a.csv").write_text("x,y\n1\n")
    done = _run("validate", {"spans": ["s1"]}, inputs, outputs)
    assert done.returncode == 2 and "span_unreadable: a.csv: line 2 has 1 cells" in done.stderr
    assert not outputs.exists() or not any(outputs.rglob("*.json")), "a refused step writes nothing"


def test_a_failed_write_leaves_no_file(tmp_path: Path) -> None:
    target = tmp_path / "out" / "statistics.json"

    def half(file: Any) -> None:
        file.write("{\"format\": ")
        raise OSError("disk full")

    with pytest.raises(OSError):
        write_atomically(target, half)
    assert list(target.parent.iterdir()) == []
    write_atomically(target, lambda file: file.write("{}"))
    assert target.read_text() == "{}" and [p.name for p in target.parent.iterdir()] == ["statistics.json"]


# ----------------------------------------------------------------------------------------------
# evaluate


def _classifier(weights: np.ndarray, bias: np.ndarray, *, input_name: str = "features") -> onnx.ModelProto:
    """``scores = softmax(x W + b)`` on ``x: float32[batch, features]`` (two classes)."""
    features = weights.shape[0]
    graph = helper.make_graph(
        [helper.make_node("MatMul", [input_name, "W"], ["z"]), helper.make_node("Add", ["z", "B"], ["logits"]),
         helper.make_node("Softmax", ["logits"], ["scores"], axis=-1)], "classifier",
        [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, ["batch", features])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", 2])],
        [numpy_helper.from_array(weights.astype(np.float32), "W"), numpy_helper.from_array(bias.astype(np.float32), "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _model_dir(folder: Path, model: onnx.ModelProto, *, input_name: str = "features", features: int = 2) -> None:
    folder.mkdir(parents=True)
    onnx.save(model, folder / "model.onnx")
    (folder / "model.yaml").write_text(yaml.safe_dump({
        "name": "defects", "max_batch_size": 64,
        "inputs": [{"name": input_name, "data_type": "fp32", "dims": [features]}],
        "outputs": [{"name": "scores", "data_type": "fp32", "dims": [2]}],
        "slo": {"p99_ms": 50.0}, "expected_rate_rps": 10.0, "pool_kinds": ["cpu"]}))


GOOD = _classifier(np.array([[-4.0, 4.0], [0.0, 0.0]]), np.zeros(2))
"""Predicts y = a > 0: right on every row."""
POOR = _classifier(np.array([[0.0, 0.0], [-4.0, 4.0]]), np.zeros(2))
"""Predicts from b, which says nothing of y: right on about half the rows."""
STEP = {"label": "y", "features": ["a", "b"], "slices": ["line"], "metrics": ["accuracy", "auc", "log_loss"],
        "min_rows": 30, "thresholds": [
            {"metric": "accuracy", "lower": 0.9},
            {"metric": "auc", "change": {"direction": "higher_is_better", "absolute": -0.01}, "slices": False}]}


def test_evaluate_first_run_blesses_on_values_and_writes_the_reference_set(tmp_path: Path) -> None:
    inputs, outputs = tmp_path / "inputs", tmp_path / "outputs"
    _write_span(inputs / "span", _columns(400, seed=3))
    _model_dir(inputs / "candidate", GOOD)
    done = _run("evaluate", STEP, inputs, outputs)
    assert done.returncode == 0, done.stderr
    result = _result(outputs)
    assert result["blessed"] is True and result["baseline"] is False and result["task"] == "binary"
    assert result["reference"] is True
    candidate = result["metrics"]["candidate"]
    assert candidate["overall"]["accuracy"] == 1.0 and candidate["overall"]["rows"] == 400
    assert set(candidate) == {"overall", "line=l1", "line=l2", "line=l3"}
    messages = [r["message"] for r in result["reasons"]]
    assert messages[0].startswith("no baseline: the first run")
    assert any(r["metric"] == "auc" and r["passed"] is None and "not judged" in r["message"] for r in result["reasons"])
    assert any(r["slice"] == "line=l3" and r["passed"] is None and "fewer than min_rows 30" in r["message"]
               for r in result["reasons"]), "a 5-row slice is reported, not judged"
    assert [r["slice"] for r in result["reasons"] if r["metric"] == "accuracy"] == [None, "line=l1", "line=l2"]

    with np.load(outputs / "reference" / "reference.npz", allow_pickle=False) as reference:
        assert sorted(reference.files) == ["feature.a", "feature.b", "labels", "predicted", "scores", "segment.line"]
        assert reference["scores"].shape == (400, 2)
        assert (reference["predicted"] == reference["labels"]).all()
        # each row's slice value, the request parameter a model pushed with monitoring: {segment: line} is split by
        assert reference["segment.line"].tolist() == _columns(400, seed=3)["line"]
    monitoring = yaml.safe_load((outputs / "reference" / "monitoring.yaml").read_text())
    assert monitoring["task"] == "binary" and monitoring["features"] == {"features": ["a", "b"]}
    assert monitoring["outputs"] == {"scores": "scores"}
    assert monitoring["rules"][0] == {"name": "accuracy-low", "signal": "mpp", "under": 0.95, "for": 3}


def test_evaluate_refuses_a_candidate_worse_than_the_baseline(tmp_path: Path) -> None:
    inputs, outputs = tmp_path / "inputs", tmp_path / "outputs"
    _write_span(inputs / "span", _columns(400, seed=4))
    _model_dir(inputs / "candidate", POOR)
    _model_dir(inputs / "baseline", GOOD)
    done = _run("evaluate", STEP | {"thresholds": [STEP["thresholds"][1]]}, inputs, outputs)
    assert done.returncode == 0, done.stderr
    result = _result(outputs)
    assert result["blessed"] is False and result["baseline"] is True
    reason = result["reasons"][0]
    assert reason["metric"] == "auc" and reason["passed"] is False, "the failed check comes first"
    assert reason["baseline_value"] == 1.0 and reason["value"] < 0.7
    assert result["metrics"]["baseline"]["overall"]["accuracy"] == 1.0

    swapped = tmp_path / "swapped"
    _write_span(swapped / "inputs" / "span", _columns(400, seed=4))
    _model_dir(swapped / "inputs" / "candidate", GOOD)
    _model_dir(swapped / "inputs" / "baseline", POOR)
    assert _run("evaluate", STEP, swapped / "inputs", swapped / "outputs").returncode == 0
    assert _result(swapped / "outputs")["blessed"] is True


def test_evaluate_skips_a_baseline_with_another_input_signature(tmp_path: Path) -> None:
    inputs, outputs = tmp_path / "inputs", tmp_path / "outputs"
    _write_span(inputs / "span", _columns(400, seed=5))
    _model_dir(inputs / "candidate", GOOD)
    _model_dir(inputs / "baseline", _classifier(np.array([[-4.0, 4.0], [0.0, 0.0]]), np.zeros(2), input_name="x"),
               input_name="x")
    done = _run("evaluate", STEP, inputs, outputs)
    assert done.returncode == 0, done.stderr
    result = _result(outputs)
    assert result["blessed"] is True and result["baseline"] is False and "baseline" not in result["metrics"]
    assert "input signature features:fp32[2] differs from the baseline's x:fp32[2]" in result["reasons"][0]["message"]


def test_evaluate_refuses_a_span_without_labels(tmp_path: Path) -> None:
    inputs, outputs = tmp_path / "inputs", tmp_path / "outputs"
    columns = _columns(50, seed=6)
    del columns["y"]
    _write_span(inputs / "span", columns)
    _model_dir(inputs / "candidate", GOOD)
    done = _run("evaluate", STEP, inputs, outputs)
    assert done.returncode == 2
    assert done.stderr.strip() == "evaluate: label_missing: span has no label column 'y'"
    assert not outputs.exists()
    columns["y"] = [None] * 50
    _write_span(inputs / "span", columns)
    done = _run("evaluate", STEP, inputs, outputs)
    assert done.returncode == 2 and "label_missing: span has no value in its label column 'y'" in done.stderr


def test_evaluate_writes_no_reference_set_the_scorer_would_refuse(tmp_path: Path) -> None:
    inputs, outputs = tmp_path / "inputs", tmp_path / "outputs"
    _write_span(inputs / "span", _columns(60, seed=7))
    _model_dir(inputs / "candidate", GOOD)
    done = _run("evaluate", STEP, inputs, outputs)
    assert done.returncode == 0, done.stderr
    result = _result(outputs)
    assert result["reference"] is False and not (outputs / "reference").exists()
    assert result["reasons"][-1]["message"] == "no reference set written: 60 rows, the monitoring-scorer needs 100"


def test_evaluate_bounds_the_quality_rule_below_the_worst_judged_slice(tmp_path: Path) -> None:
    """A model monitored per line checks each line's windows with the version's rule: the bound sits below
    the worst line judged (l2's, a fifth of its labels flipped), not below the lines together."""
    inputs, outputs = tmp_path / "inputs", tmp_path / "outputs"
    columns = _columns(400, seed=4)
    l2 = [i for i, line in enumerate(columns["line"]) if line == "l2"]
    for i in l2[::5]:
        columns["y"][i] = 1 - columns["y"][i]
    _write_span(inputs / "span", columns)
    _model_dir(inputs / "candidate", GOOD)
    done = _run("evaluate", STEP | {"thresholds": []}, inputs, outputs)
    assert done.returncode == 0, done.stderr
    candidate = _result(outputs)["metrics"]["candidate"]
    worst = candidate["line=l2"]["accuracy"]
    assert worst < candidate["overall"]["accuracy"] - 0.05 and candidate["line=l3"]["rows"] < STEP["min_rows"]
    monitoring = yaml.safe_load((outputs / "reference" / "monitoring.yaml").read_text())
    assert monitoring["rules"][0]["under"] == pytest.approx(worst - 0.05, abs=1e-6)


def test_evaluate_a_regressor(tmp_path: Path) -> None:
    inputs, outputs = tmp_path / "inputs", tmp_path / "outputs"
    columns = _columns(200, seed=8)
    columns["y"] = [f"{2 * float(a) + 1:.5f}" for a in columns["a"]]
    _write_span(inputs / "span", columns)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["features", "W"], ["z"]), helper.make_node("Add", ["z", "B"], ["value"])],
        "linear", [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", 2])],
        [helper.make_tensor_value_info("value", TensorProto.FLOAT, ["batch", 1])],
        [numpy_helper.from_array(np.array([[2.0], [0.0]], dtype=np.float32), "W"),
         numpy_helper.from_array(np.array([1.5], dtype=np.float32), "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    _model_dir(inputs / "candidate", model)
    config = yaml.safe_load((inputs / "candidate" / "model.yaml").read_text())
    config["outputs"] = [{"name": "value", "data_type": "fp32", "dims": [1]}]
    (inputs / "candidate" / "model.yaml").write_text(yaml.safe_dump(config))
    step = {"label": "y", "features": ["a", "b"], "metrics": ["mae", "rmse"],
            "thresholds": [{"metric": "mae", "upper": 0.4}]}
    done = _run("evaluate", step, inputs, outputs)
    assert done.returncode == 0, done.stderr
    result = _result(outputs)
    assert result["task"] == "regression" and result["blessed"] is False  # off by 0.5 on every row
    assert result["metrics"]["candidate"]["overall"]["mae"] == pytest.approx(0.5, abs=1e-4)
    monitoring = yaml.safe_load((outputs / "reference" / "monitoring.yaml").read_text())
    assert monitoring["outputs"] == {"predicted": "value"}
    assert monitoring["rules"][0]["signal"] == "mpp" and monitoring["rules"][0]["over"] == pytest.approx(0.525, 1e-3)
    done = _run("evaluate", step | {"metrics": ["accuracy"], "thresholds": []}, inputs, tmp_path / "again")
    assert done.returncode == 2 and "step_invalid: step.metrics: ['accuracy'] are not defined for a regression" in done.stderr


def test_evaluate_skips_a_baseline_that_no_longer_runs(tmp_path: Path) -> None:
    inputs, outputs = tmp_path / "inputs", tmp_path / "outputs"
    _write_span(inputs / "span", _columns(200, seed=9))
    _model_dir(inputs / "candidate", GOOD)
    _model_dir(inputs / "baseline", GOOD)
    (inputs / "baseline" / "model.onnx").write_bytes(b"not a model")
    done = _run("evaluate", STEP, inputs, outputs)
    assert done.returncode == 0, done.stderr
    result = _result(outputs)
    assert result["blessed"] is True and result["baseline"] is False
    assert result["reasons"][0]["message"].startswith("baseline comparison skipped: baseline: onnxruntime:")
