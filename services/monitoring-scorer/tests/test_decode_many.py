"""decode_predictions: a version's events decoded together give the rows of decoding each (pure logic)."""

from __future__ import annotations

import numpy as np
import pytest
from opml.inference.v1 import events_pb2
from tritonclient.grpc import service_pb2 as pb

from opml_common.errors import InvalidArgument
from opml_common.kserve_codec import encode_outputs, encode_request
from opml_monitoring_scorer.core.decode import Batch, decode_prediction, decode_predictions
from opml_monitoring_scorer.core.reference import Task

NAMES = {"x": ["a", "b"]}


def _event(i: int, n: int) -> events_pb2.PredictionMade:
    rng = np.random.default_rng(i)
    p = rng.uniform(size=(n, 1)).astype(np.float32)
    request = encode_request("m", {"x": rng.normal(size=(n, 2)).astype(np.float32),
                                   "color": np.array([[b"red"]] * n, dtype=object).reshape(n, 1)})
    response = encode_outputs(pb.ModelInferResponse(), {"probabilities": np.hstack([1 - p, p])})
    return events_pb2.PredictionMade(request_id=f"r{i}", model_name="m", model_version="1",
                                     infer_request=request.SerializeToString(),
                                     infer_response=response.SerializeToString())


def test_together_equals_one_by_one_with_summary_only_events_and_batches() -> None:
    events = [_event(0, 1), _event(1, 10), events_pb2.PredictionMade(request_id="s"), _event(3, 1)]
    batch, rows = decode_predictions(events, task=Task.BINARY, feature_names=NAMES)
    expected = Batch.concat([decode_prediction(e, task=Task.BINARY, feature_names=NAMES) for e in events])
    assert rows == [1, 10, 0, 1] and batch.summary_only == expected.summary_only == 1
    assert batch.request_ids == expected.request_ids
    assert sorted(batch.features) == sorted(expected.features) == ["a", "b", "color"]
    for name, column in expected.features.items():
        assert batch.features[name].tolist() == column.tolist()
    assert batch.outputs.predicted.tolist() == expected.outputs.predicted.tolist()
    assert batch.outputs.scores.tolist() == expected.outputs.scores.tolist()
    part = batch.rows(1, 11)
    assert part.request_ids == [f"r1#{i}" for i in range(10)] and len(part.features["a"]) == 10


def test_a_bad_event_fails_the_group_so_the_stream_decodes_one_by_one() -> None:
    bad = _event(1, 1)
    bad.infer_request = bad.infer_request[:-3]
    with pytest.raises(InvalidArgument):
        decode_predictions([_event(0, 1), bad], task=Task.BINARY, feature_names=NAMES)
    with pytest.raises(InvalidArgument):
        decode_prediction(bad, task=Task.BINARY, feature_names=NAMES)


def test_class_names_as_the_predicted_output_are_refused_naming_the_tensor() -> None:
    """A model serving its class names (a BYTES tensor) where monitoring.yaml points outputs.predicted
    used to raise a plain ValueError (float of b'scratch'), dead-lettered without a field; the scorer
    takes class indexes, as the reference holds them."""
    event = _event(0, 3)
    response = encode_outputs(pb.ModelInferResponse(), {
        "probabilities": np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4]], np.float32),
        "label": np.array([[b"ok"], [b"scratch"], [b"ok"]], dtype=object)})
    event.infer_response = response.SerializeToString()
    for decode in (lambda: decode_prediction(event, task=Task.BINARY, feature_names=NAMES, predicted_output="label"),
                   lambda: decode_predictions([event], task=Task.BINARY, feature_names=NAMES,
                                              predicted_output="label"),
                   lambda: decode_prediction(event, task=Task.BINARY, feature_names=NAMES, scores_output="label"),
                   lambda: decode_prediction(event, task=Task.REGRESSION, feature_names=NAMES,
                                             predicted_output="label")):
        with pytest.raises(InvalidArgument) as caught:
            decode()
        assert [field for field, _ in caught.value.violations] == ["infer_response.outputs[label]"]
        assert "class names" in str(caught.value)
