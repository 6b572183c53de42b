"""The router's data plane: load-aware choice of replicas, admission, backup requests, retries, canary.

Transport-free; the :class:`Replica` implementations are imported from their modules:
:mod:`.grpc_replica` (a worker process over gRPC), :mod:`.uds_replica` (a worker on this machine over
its Unix socket; its ``connect`` picks between the two by address) and :mod:`.local_replica` (a
worker's servicer in the router's own process). The frontend (KServe v2 gRPC servicer) is
:mod:`opml_inference_router.frontend`.
"""

from opml_inference_router.routing.admission import ConcurrencyLimiter, Shed
from opml_inference_router.routing.canary import TrafficSplit
from opml_inference_router.routing.errors import DeadlineExceeded, ReplicaFailed
from opml_inference_router.routing.latency import LatencyWindow
from opml_inference_router.routing.policy import ModelPolicy
from opml_inference_router.routing.replicas import Replica, ReplicaSet, ReplicaState
from opml_inference_router.routing.router import Routed, Router

__all__ = [
    "ConcurrencyLimiter",
    "DeadlineExceeded",
    "LatencyWindow",
    "ModelPolicy",
    "Replica",
    "ReplicaFailed",
    "ReplicaSet",
    "ReplicaState",
    "Routed",
    "Router",
    "Shed",
    "TrafficSplit",
]
