"""A replica in the router's own process: a worker's KServe servicer called without gRPC.

For single-node deployments and latency-critical models: the request skips the second network hop
and its encode/decode (the router's overhead over onnxruntime is then one gRPC hop; see
bench/inference_router_overhead.py). The price is isolation: the model shares the router's process,
so a worker killed mid-request takes the router with it, which remote replicas survive.

Wraps any ``GRPCInferenceServiceServicer`` (the worker's ``WorkerServicer`` over a
``ModelRepository``, with its dynamic batching); the servicer's platform errors become
:class:`ReplicaFailed` with the same retry decisions as :mod:`.grpc_replica` (``ReplicaFailed.of_status``).
"""

from __future__ import annotations

import asyncio

from tritonclient.grpc import service_pb2 as pb

from opml_common.errors import OpmlError
from opml_inference_router.routing.errors import ReplicaFailed
from opml_inference_router.routing.replicas import Replica

_REQUEST_TYPES = {"ModelInfer": pb.ModelInferRequest, "ModelMetadata": pb.ModelMetadataRequest,
                  "ModelReady": pb.ModelReadyRequest}


class LocalReplica(Replica):
    """``servicer``'s methods as a replica named ``name`` (use it in ``connect`` for that address)."""

    def __init__(self, servicer: object, *, name: str = "local") -> None:
        self.name = name
        self._servicer = servicer

    async def call(self, method: str, request: bytes, *, timeout_s: float) -> bytes:
        try:
            async with asyncio.timeout(timeout_s):
                reply = await getattr(self._servicer, method)(_REQUEST_TYPES[method].FromString(request), None)
        except TimeoutError:
            raise ReplicaFailed("DEADLINE_EXCEEDED", f"no answer within {timeout_s * 1000:.1f} ms",
                                retriable=False, eject=False, replica=self.name) from None
        except OpmlError as exc:
            raise ReplicaFailed.of_status(exc.code, exc.message, replica=self.name) from None
        return reply.SerializeToString()

    async def close(self) -> None:
        """The servicer's owner releases its models (``ModelRepository.close``)."""
