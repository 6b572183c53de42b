"""How the router's prediction events are made (protos/opml/inference/v1/events.proto): the router
builds every prediction it publishes with these functions, and a consumer, a test or a tool that
publishes predictions in its stead builds the same events with them.

A record on :data:`~opml_inference_router_contract.topics.PREDICTIONS` is one ``PredictionMade``, or
a ``PredictionBatch`` of several predictions of one model version in the order they were served; either
way its subject and Kafka key is :func:`prediction_subject`, so one version's predictions stay in order
on one partition. A prediction carries the KServe v2 request and response as wire bytes when each is at
most the router's record cap (``record_cap_bytes``); above it, per-tensor summaries
(:func:`tensor_summaries`) instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from opml.inference.v1 import events_pb2
from tritonclient.grpc import service_pb2 as pb

from opml_common.kserve_codec import BY_KSERVE

RECORD_CAP_BYTES = 64 * 1024
"""The router's default record cap: a few thousand features, a small image."""


def prediction_subject(model: str, version: str) -> str:
    """The CloudEvents subject and Kafka key of a model version's prediction records."""
    return f"{model}/{version}"


def prediction_made(*, request_id: str, model: str, version: str, request: bytes, response: bytes,
                    received: float, latency_s: float = 0.0, replica: str = "", attempts: int = 1,
                    backup_won: bool = False, record_cap_bytes: int = RECORD_CAP_BYTES,
                    into: events_pb2.PredictionMade | None = None) -> events_pb2.PredictionMade:
    """The PredictionMade of one served request: ``request`` and ``response`` are the serialized
    ``ModelInferRequest`` and ``ModelInferResponse``, recorded as they are when at most
    ``record_cap_bytes``, else summarised; ``received``: when the request came (seconds since the
    epoch). ``into``: the message to fill (e.g. ``batch.predictions.add()``, so a batch is built
    without copies), a new one by default."""
    event = events_pb2.PredictionMade() if into is None else into
    event.request_id, event.model_name, event.model_version = request_id, model, version
    event.latency_ms, event.replica = latency_s * 1000.0, replica
    event.backup_won, event.attempts = backup_won, attempts
    event.time.FromNanoseconds(int(received * 1e9))
    if len(request) <= record_cap_bytes:
        event.infer_request = request
    else:
        parsed = pb.ModelInferRequest.FromString(request)
        event.input_summaries.extend(tensor_summaries(parsed.inputs, parsed.raw_input_contents))
    if len(response) <= record_cap_bytes:
        event.infer_response = response
    else:
        parsed = pb.ModelInferResponse.FromString(response)
        event.output_summaries.extend(tensor_summaries(parsed.outputs, parsed.raw_output_contents))
    return event


def tensor_summaries(tensors: Sequence, raw_contents: Sequence[bytes]) -> list[events_pb2.TensorSummary]:
    """Per tensor of a KServe v2 request's ``inputs`` or a response's ``outputs`` (with their
    ``raw_*_contents``): datatype, shape, and statistics of numeric values (raw or typed contents)."""
    summaries = []
    for index, tensor in enumerate(tensors):
        summary = events_pb2.TensorSummary(name=tensor.name, datatype=tensor.datatype, shape=list(tensor.shape))
        datatype = BY_KSERVE.get(tensor.datatype)
        if datatype is not None and datatype.kserve != "BYTES":
            try:
                if index < len(raw_contents):
                    values = np.frombuffer(raw_contents[index], dtype=datatype.numpy)
                elif datatype.contents_field is not None:
                    values = np.asarray(getattr(tensor.contents, datatype.contents_field), dtype=datatype.numpy)
                else:
                    values = np.empty(0)
                values = values.astype(np.float64)
            except ValueError:  # contents that do not match the datatype: no statistics
                values = np.empty(0)
            if values.size:
                summary.has_stats = True
                summary.mean, summary.std = float(values.mean()), float(values.std())
                summary.min, summary.max = float(values.min()), float(values.max())
        summaries.append(summary)
    return summaries
