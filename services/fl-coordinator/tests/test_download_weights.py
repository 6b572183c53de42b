"""DownloadWeights sends the global model in messages of at most ``chunk_bytes`` of data and no more
than ``max_model_bytes`` in all; the contract client rebuilds it within the same bounds as a task."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from opml.fl.v1 import fl_pb2 as pb
from prometheus_client import CollectorRegistry

from opml_common.errors import FailedPrecondition, InvalidArgument
from opml_common.metrics import ServiceMetrics
from opml_fl_coordinator.metrics import FlMetrics
from opml_fl_coordinator.servicer import FederationServicer
from opml_fl_coordinator_contract.client import _weights_by_index
from opml_fl_coordinator_contract.names import federation_name
from opml_fl_coordinator_contract.weights import chunks

MODEL = [np.arange(3000, dtype=np.float32).reshape(60, 50), np.zeros(0, np.float32), np.linspace(0, 1, 700)]
MODEL_BYTES = sum(w.nbytes for w in MODEL)


class Coordinator:
    """What DownloadWeights reads of the coordinator: a federation's current weights."""

    def __init__(self, weights: list[np.ndarray]) -> None:
        self.weights = weights

    def get(self, federation_id: str) -> SimpleNamespace:
        return SimpleNamespace(federation=SimpleNamespace(weights=self.weights))


def servicer(weights: list[np.ndarray], *, chunk_bytes: int, max_model_bytes: int) -> FederationServicer:
    return FederationServicer(Coordinator(weights), chunk_bytes=chunk_bytes, max_model_bytes=max_model_bytes,
                              metrics=FlMetrics(ServiceMetrics("fl-coordinator", CollectorRegistry())))


async def download(service: FederationServicer) -> list[pb.ArrayChunk]:
    return [c async for c in service.DownloadWeights(pb.DownloadWeightsRequest(name=federation_name("f")), None)]


async def test_the_model_comes_in_messages_of_at_most_chunk_bytes_and_back_whole() -> None:
    sent = await download(servicer(MODEL, chunk_bytes=1024, max_model_bytes=MODEL_BYTES))
    assert max(len(c.data) for c in sent) == 1024
    assert sum(len(c.data) for c in sent) == MODEL_BYTES
    got = _weights_by_index(iter(sent))
    assert [g.shape for g in got] == [w.shape for w in MODEL]
    assert all(np.array_equal(g, w) for g, w in zip(got, MODEL, strict=True))


async def test_a_model_over_max_model_bytes_is_not_sent() -> None:
    with pytest.raises(FailedPrecondition, match="max_model_bytes"):
        await download(servicer(MODEL, chunk_bytes=1024, max_model_bytes=MODEL_BYTES - 1))


def test_the_client_refuses_a_download_past_its_bound_or_cut_inside_an_array() -> None:
    with pytest.raises(InvalidArgument, match="exceeds"):
        _weights_by_index(chunks(MODEL, 1024), max_bytes=MODEL_BYTES - 1)
    cut = list(chunks(MODEL, 1024))[:-1]
    with pytest.raises(InvalidArgument, match="ended inside array 2"):
        _weights_by_index(iter(cut))
    late = list(chunks(MODEL, 1024))
    late[1].offset += 1
    with pytest.raises(InvalidArgument, match="offset"):
        _weights_by_index(iter(late))
