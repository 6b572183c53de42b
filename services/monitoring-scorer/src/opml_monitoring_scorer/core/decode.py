"""A PredictionMade event -> the rows it holds: named feature columns and the model's outputs.

The KServe v2 request and response bytes are decoded by the platform's one codec
(``opml_common.kserve_codec``), exactly as the router encoded them. Each input tensor of shape
``[batch, k]`` gives k features, named by the monitoring config (``features: {tensor: [names]}``),
else ``tensor`` when k is 1 and ``tensor[i]`` otherwise; a tensor of shape ``[batch]`` is one feature; a
numeric tensor of more than ``MAX_COLUMNS`` values per row (an image) gives four: its per-row mean,
std, min and max.
Outputs: the classifier's scores are the configured tensor or the first float tensor; the predicted
class is the configured tensor or the scores' argmax (a single score column is P(class 1), cut at 0.5);
a regression's prediction is the configured tensor or the first output.

Many events of one version are decoded together (:func:`decode_predictions`): their tensors stacked
and decoded in one numpy call each, the features and outputs built once, so a stream of one-row
requests does not pay a decode per row.

An event that carries summaries only (tensors past the router's record cap) has no rows: it is
counted as ``summary_only`` and its input statistics are kept (``Batch.summaries``), which the
window's drift and data quality compare with the reference summarised the same way (summary.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from opml.inference.v1 import events_pb2
from tritonclient.grpc import service_pb2 as pb

from opml_common.errors import InvalidArgument
from opml_common.kserve_codec import decode_request, decode_response, decode_stacked
from opml_monitoring_scorer.core.reference import Outputs, Task, as_column
from opml_monitoring_scorer.core.summary import PredictionSummary, summary_of

MAX_ROWS_PER_EVENT = 100_000
MAX_COLUMNS = 256
"""A numeric input wider than this (unless the config names its columns) is monitored by its per-row
mean, std, min and max."""


@dataclass
class Batch:
    """Rows of one or more predictions: feature columns, outputs, and per row its request id; and what
    its summary-only predictions carry."""

    features: dict[str, np.ndarray]
    outputs: Outputs
    request_ids: list[str]
    summary_only: int = 0
    summaries: list[PredictionSummary] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.outputs)

    def rows(self, start: int, stop: int) -> Batch:
        """Rows ``start`` to ``stop`` (views of the same arrays; no summary-only predictions)."""
        outputs = self.outputs
        scores = None if outputs.scores is None else outputs.scores[start:stop]
        return Batch({name: column[start:stop] for name, column in self.features.items()},
                     Outputs(outputs.predicted[start:stop], scores), self.request_ids[start:stop])

    @staticmethod
    def concat(batches: Sequence[Batch], *, summary_only: int | None = None,
               summaries: list[PredictionSummary] | None = None) -> Batch:
        """The rows of ``batches`` in order; ``summary_only`` and ``summaries``: the summary-only events
        counted and what they carry (default: the batches' own)."""
        rows = [b for b in batches if len(b)]
        summary = sum(b.summary_only for b in batches) if summary_only is None else summary_only
        if summaries is None:
            summaries = [s for b in batches for s in b.summaries]
        if not rows:
            return Batch({}, Outputs(np.empty(0)), [], summary, summaries)
        names = set().union(*(b.features for b in rows))
        features = {}
        for name in names:
            parts = [b.features[name] if name in b.features else _absent(b, rows) for b in rows]
            features[name] = np.concatenate(parts)
        scores = None
        if all(b.outputs.scores is not None for b in rows):
            scores = np.concatenate([b.outputs.class_scores() for b in rows])
        return Batch(features, Outputs(np.concatenate([b.outputs.predicted for b in rows]), scores),
                     [r for b in rows for r in b.request_ids], summary, summaries)


def _absent(batch: Batch, rows: Sequence[Batch]) -> np.ndarray:
    """A column a batch lacks: NaN, or None for a categorical column (the data-quality check sees it)."""
    kind = next(b.features for b in rows if b.features)
    sample = next(iter(kind.values()))
    return np.full(len(batch), np.nan) if sample.dtype != object else np.full(len(batch), None, dtype=object)


def _columns(name: str, array: np.ndarray, names: Mapping[str, list[str]], field: str) -> dict[str, np.ndarray]:
    if array.ndim == 0:
        raise InvalidArgument(field, "is a scalar; a monitored input has a batch dimension")
    flat = array.reshape(array.shape[0], -1)
    width = flat.shape[1]
    if width > MAX_COLUMNS and name not in names and flat.dtype.kind in "biuf":
        # an image or an embedding: its per-row statistics are the features (drift of brightness,
        # contrast, range), not one column per pixel
        values = flat.astype(np.float64)
        return {f"{name}.mean": values.mean(axis=1), f"{name}.std": values.std(axis=1),
                f"{name}.min": values.min(axis=1), f"{name}.max": values.max(axis=1)}
    given = names.get(name)
    if given is not None and len(given) != width:
        raise InvalidArgument(field, f"has {width} columns, but the monitoring config names {len(given)} features")
    labels = given or ([name] if width == 1 else [f"{name}[{i}]" for i in range(width)])
    return {label: as_column(flat[:, i]) for i, label in enumerate(labels)}


def decode_prediction(event: events_pb2.PredictionMade, *, task: Task, feature_names: Mapping[str, list[str]],
                      scores_output: str | None = None, predicted_output: str | None = None) -> Batch:
    """Raises: InvalidArgument: the request or response does not decode, holds more than
    ``MAX_ROWS_PER_EVENT`` rows, or its tensors disagree on the batch size."""
    if not event.infer_request or not event.infer_response:
        return Batch({}, Outputs(np.empty(0)), [], summary_only=1, summaries=[summary_of(event)])
    try:
        request = pb.ModelInferRequest.FromString(event.infer_request)
        response = pb.ModelInferResponse.FromString(event.infer_response)
    except Exception as exc:  # noqa: BLE001 - protobuf raises DecodeError and friends
        raise InvalidArgument("infer_request", f"is not a KServe v2 message: {exc}") from None
    inputs = decode_request(request)
    outputs = decode_response(response)
    features: dict[str, np.ndarray] = {}
    for name, array in inputs.items():
        features.update(_columns(name, array, feature_names, f"infer_request.inputs[{name}]"))
    rows = {len(c) for c in features.values()}
    if len(rows) > 1:
        raise InvalidArgument("infer_request.inputs", f"tensors disagree on the batch size: {sorted(rows)}")
    out = _outputs(outputs, task, scores_output, predicted_output)
    n = len(out)
    if rows and rows != {n}:
        raise InvalidArgument("infer_response.outputs", f"hold {n} rows, but the request holds {rows.pop()}")
    if n > MAX_ROWS_PER_EVENT:
        raise InvalidArgument("infer_request", f"holds {n} rows, more than {MAX_ROWS_PER_EVENT}")
    ids = [event.request_id] if n == 1 else [f"{event.request_id}#{i}" for i in range(n)]
    return Batch(features, out, ids)


def decode_predictions(events: Sequence[events_pb2.PredictionMade], *, task: Task,
                       feature_names: Mapping[str, list[str]], scores_output: str | None = None,
                       predicted_output: str | None = None) -> tuple[Batch, list[int]]:
    """Many events of one version decoded together: their rows in order in one Batch (summary-only
    events counted in it), and each event's row count (0 for a summary-only one). The same rows as
    :func:`decode_prediction` of each and :meth:`Batch.concat`.

    Raises:
        InvalidArgument: an event does not decode, or the events' tensors differ in layout (names,
            datatypes, dims past the batch): decode them one by one to know which.
    """
    full = [e for e in events if e.infer_request and e.infer_response]
    summaries = [summary_of(e) for e in events if not (e.infer_request and e.infer_response)]
    summary = len(summaries)
    if not full:
        return Batch({}, Outputs(np.empty(0)), [], summary, summaries), [0] * len(events)
    try:
        requests = [pb.ModelInferRequest.FromString(e.infer_request) for e in full]
        responses = [pb.ModelInferResponse.FromString(e.infer_response) for e in full]
    except Exception as exc:  # noqa: BLE001 - protobuf raises DecodeError and friends
        raise InvalidArgument("infer_request", f"is not a KServe v2 message: {exc}") from None
    inputs, sizes = decode_stacked(requests)
    outputs, output_sizes = decode_stacked(responses)
    if inputs and sizes != output_sizes:
        raise InvalidArgument("infer_response.outputs", "hold other batch sizes than their requests")
    if not inputs:
        sizes = output_sizes
    if max(sizes) > MAX_ROWS_PER_EVENT:
        raise InvalidArgument("infer_request", f"holds {max(sizes)} rows, more than {MAX_ROWS_PER_EVENT}")
    features: dict[str, np.ndarray] = {}
    for name, array in inputs.items():
        features.update(_columns(name, array, feature_names, f"infer_request.inputs[{name}]"))
    out = _outputs(outputs, task, scores_output, predicted_output)
    ids = [event.request_id if n == 1 else f"{event.request_id}#{i}"
           for event, n in zip(full, sizes, strict=True) for i in range(n)]
    counts = iter(sizes)
    rows = [next(counts) if e.infer_request and e.infer_response else 0 for e in events]
    return Batch(features, out, ids, summary, summaries), rows


def _outputs(outputs: Mapping[str, np.ndarray], task: Task, scores_name: str | None,
             predicted_name: str | None) -> Outputs:
    for name in (scores_name, predicted_name):
        if name is not None and name not in outputs:
            raise InvalidArgument(f"infer_response.outputs[{name}]",
                                  f"is missing; the response has {', '.join(outputs) or 'no outputs'}")
    if not outputs:
        raise InvalidArgument("infer_response.outputs", "is empty")
    if task is Task.REGRESSION:
        name = predicted_name or next(iter(outputs))
        array = _numbers(outputs[name], name, "predicted values")
        return Outputs(array.reshape(array.shape[0], -1)[:, 0])
    name = scores_name or next((n for n, a in outputs.items() if a.dtype.kind == "f"), None)
    if name is None:
        raise InvalidArgument("infer_response.outputs", "hold no float tensor of class scores")
    scores = _numbers(outputs[name], name, "class scores")
    scores = scores.reshape(scores.shape[0], -1)
    probs = Outputs(np.zeros(len(scores)), scores).class_scores()
    assert probs is not None
    if predicted_name is not None:
        predicted = _numbers(outputs[predicted_name], predicted_name, "class indexes (0, 1, ...)")
        predicted = predicted.reshape(len(scores), -1)[:, 0]
    else:
        predicted = np.argmax(probs, axis=1).astype(np.float64)
    return Outputs(predicted, scores)


def _numbers(array: np.ndarray, name: str, what: str) -> np.ndarray:
    """An output tensor as float64. Raises: InvalidArgument: it holds text (class names, in a BYTES
    tensor): the scorer compares predictions with labels by class index, as the reference holds them."""
    if array.dtype.kind in "OSU":
        raise InvalidArgument(f"infer_response.outputs[{name}]",
                              f"must hold {what}, but holds text (class names?): the scorer takes class indexes, "
                              "as the reference holds them; without outputs.predicted in monitoring.yaml the "
                              "class is the scores' argmax")
    return array.astype(np.float64)
