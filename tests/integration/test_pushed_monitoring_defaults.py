"""The monitoring.yaml the pipeline's evaluate step writes, read by the monitoring-scorer's own scoring:
a clean stream drawn like the reference raises no alert, on an image-like model of 256 pixel columns
(the fixed 5 % bad-input bound fired on every clean window of it: a row is flagged when any of its
256 columns falls outside the reference's range) as on a model of a few features; a stream of broken
inputs still raises the bad-input alert. Monitored per line (the push's ``monitoring: {segment: line}``), each
line's clean stream, whose inputs differ from the other line's by design, raises no alert against its
own reference rows (the evaluate step writes each row's line), and a line whose lamps change does. No services: the step program runs as the engine runs it (a
subprocess over folders), its outputs go through the scorer's reference loader, config parser, KServe
v2 decoder, monitor and rules."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper
from opml.inference.v1 import events_pb2
from tritonclient.grpc import service_pb2 as pb

from opml_common.kserve_codec import encode_outputs, encode_request
from opml_monitoring_scorer.core.config import MonitoringConfig
from opml_monitoring_scorer.core.decode import decode_predictions
from opml_monitoring_scorer.core.monitor import ModelMonitor
from opml_monitoring_scorer.core.rules import RuleState, observe, step
from opml_monitoring_scorer.core.scorer import load_reference

WINDOWS = 6


def classifier(columns: int, rng: np.random.Generator) -> onnx.ModelProto:
    """``softmax(x W)`` over ``x: float32[batch, columns]``, two classes."""
    weights = rng.normal(0, 3 / np.sqrt(columns), size=(columns, 2)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["pixels", "W"], ["logits"]),
         helper.make_node("Softmax", ["logits"], ["scores"], axis=-1)], "classifier",
        [helper.make_tensor_value_info("pixels", TensorProto.FLOAT, ["batch", columns])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", 2])],
        [numpy_helper.from_array(weights, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def draw(rng: np.random.Generator, rows: int, columns: int, lamps: float = 0.5) -> np.ndarray:
    """Image-like rows: each pixel a smooth brightness (around ``lamps``) plus sensor noise."""
    brightness = rng.normal(lamps, 0.1, size=(rows, 1))
    return (brightness + rng.normal(0, 0.05, size=(rows, columns))).astype(np.float32)


def evaluate(tmp_path: Path, columns: int, rows: int, rng: np.random.Generator,
             lines: dict[str, float] | None = None) -> tuple[onnx.ModelProto, Path]:
    """The evaluate step program over a labelled span of ``rows`` (``lines``: that many rows of each line
    under its lamps, sliced by ``line``): its reference folder."""
    inputs, outputs = tmp_path / "inputs", tmp_path / "outputs"
    model = classifier(columns, rng)
    (inputs / "candidate").mkdir(parents=True)
    onnx.save(model, inputs / "candidate" / "model.onnx")
    (inputs / "candidate" / "model.yaml").write_text(yaml.safe_dump({
        "name": "defects", "max_batch_size": 64,
        "inputs": [{"name": "pixels", "data_type": "fp32", "dims": [columns]}],
        "outputs": [{"name": "scores", "data_type": "fp32", "dims": [2]}],
        "slo": {"p99_ms": 50.0}, "expected_rate_rps": 10.0, "pool_kinds": ["cpu"]}))
    lamps = lines or {"": 0.5}
    x = np.concatenate([draw(rng, rows, columns, level) for level in lamps.values()])
    line_of = [line for line in lamps for _ in range(rows)]
    names = [f"p{i}" for i in range(columns)]
    (inputs / "span").mkdir()
    labels = rng.integers(0, 2, size=len(x))
    text = [",".join([*names, "line", "y"])] + [",".join([*(f"{v:.5f}" for v in row), line, str(y)])
                                                for row, line, y in zip(x, line_of, labels, strict=True)]
    (inputs / "span" / "part-0.csv").write_text("\n".join(text) + "\n")
    step_file = tmp_path / "step.json"
    step_file.write_text(json.dumps({"label": "y", "features": names, "metrics": ["accuracy"], "thresholds": [],
                                     **({"slices": ["line"]} if lines else {})}))
    done = subprocess.run([sys.executable, "-m", "opml_job_orchestrator.pipelines.stepjobs", "evaluate", "--step",
                           str(step_file), "--inputs", str(inputs), "--outputs", str(outputs)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return model, outputs / "reference"


def predictions(model: onnx.ModelProto, x: np.ndarray) -> list[events_pb2.PredictionMade]:
    """One-row requests as the router logs them, the model's scores computed here (softmax(x W))."""
    weights = numpy_helper.to_array(model.graph.initializer[0])
    logits = x @ weights
    scores = np.exp(logits - logits.max(axis=1, keepdims=True))
    scores = (scores / scores.sum(axis=1, keepdims=True)).astype(np.float32)
    made = []
    for i in range(len(x)):
        request = encode_request("defects", {"pixels": x[i:i + 1]}, request_id=f"r{i}")
        response = encode_outputs(pb.ModelInferResponse(id=f"r{i}"), {"scores": scores[i:i + 1]})
        made.append(events_pb2.PredictionMade(request_id=f"r{i}", model_name="defects", model_version="1",
                                              infer_request=request.SerializeToString(),
                                              infer_response=response.SerializeToString()))
    return made


def alerts_of(reference_dir: Path, model: onnx.ModelProto, windows: list[np.ndarray],
              line: str | None = None) -> list[tuple[int, str]]:
    """(window, rule) of every alert the scorer's rules raise over these windows; checks the bad share.
    ``line``: judged as the scorer judges that segment (its own reference rows, the whole reference's
    value ranges)."""
    config = MonitoringConfig.parse((reference_dir / "monitoring.yaml").read_bytes())
    reference = load_reference((reference_dir / "reference.npz").read_bytes(), task=config.task)
    monitor = ModelMonitor(reference, config)
    if line is not None:
        monitor = ModelMonitor(reference.segment("line", line), config, quality=monitor.quality)
    states = {rule.name: RuleState() for rule in config.rules}
    raised = []
    for index, x in enumerate(windows):
        batch, _ = decode_predictions(predictions(model, x), task=monitor.task, feature_names=config.feature_names,
                                      scores_output=config.scores_output)
        score = monitor.score(batch, index=index, first_time=0.0, last_time=1.0)
        for rule in config.rules:
            change = step(rule, states[rule.name], observe(rule, score.signals(), score.drift_signals()), index)
            if change is not None and change.raised:
                raised.append((index, rule.name))
    return raised


@pytest.mark.parametrize(("columns", "rows"), [(256, 1000), (4, 400)])
def test_a_clean_stream_raises_no_alert_and_broken_inputs_still_do(tmp_path: Path, columns: int, rows: int) -> None:
    rng = np.random.default_rng(columns)
    model, reference_dir = evaluate(tmp_path, columns, rows, rng)
    config = yaml.safe_load((reference_dir / "monitoring.yaml").read_text())
    [bad_input] = [r for r in config["rules"] if r["name"] == "bad-input"]
    window = config["window"]["count"]
    clean = [draw(rng, window, columns) for _ in range(WINDOWS)]
    assert alerts_of(reference_dir, model, clean) == [], "clean traffic from the reference's distribution"
    if columns == 256:
        # what the fixed 5 % bound saw: a large share of clean rows has a pixel past the reference's range
        reference = np.load(reference_dir / "reference.npz")
        low = np.array([reference[f"feature.p{i}"].min() for i in range(columns)])
        high = np.array([reference[f"feature.p{i}"].max() for i in range(columns)])
        share = float(((clean[0] < low) | (clean[0] > high)).any(axis=1).mean())
        assert 0.05 < share < bad_input["over"], (share, bad_input)
    broken = draw(rng, window, columns)
    broken[:, 0] = 50.0  # a dead sensor stuck far past its range on every row
    assert (0, "bad-input") in alerts_of(reference_dir, model, [broken])


def test_each_line_is_judged_against_its_own_rows_so_only_the_changed_line_alerts(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    lamps = {"1": 0.3, "2": 0.7}  # the lines' lamps differ by design
    model, reference_dir = evaluate(tmp_path, 256, 500, rng, lamps)
    window = yaml.safe_load((reference_dir / "monitoring.yaml").read_text())["window"]["count"]
    for line, level in lamps.items():
        clean = [draw(rng, window, 256, level) for _ in range(4)]
        assert alerts_of(reference_dir, model, clean, line) == [], f"line {line}'s clean traffic"
        assert (1, "input-drift") in alerts_of(reference_dir, model, clean), "against every line's rows it drifts"
    dimmed = [draw(rng, window, 256, 0.2) for _ in range(2)]  # line 2's lamps dim
    assert (1, "input-drift") in alerts_of(reference_dir, model, dimmed, "2")
