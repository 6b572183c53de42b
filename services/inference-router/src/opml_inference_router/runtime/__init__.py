"""The worker's transport-free core: bundles, onnxruntime sessions per pool kind, replicas, dynamic
batching, profiling and the repository of what one worker hosts. Imports no grpc."""

from opml_inference_router.runtime.batcher import DynamicBatcher
from opml_inference_router.runtime.bundle import ModelBundle, load_bundle
from opml_inference_router.runtime.metrics import WorkerMetrics
from opml_inference_router.runtime.profiler import (
    BatchTiming,
    ProfileReport,
    batch_ladder,
    profile_replica,
    synthetic_inputs,
    to_profile,
)
from opml_inference_router.runtime.replica import Replica, batch_cap
from opml_inference_router.runtime.repository import IndexEntry, ModelRepository, Served
from opml_inference_router.runtime.session import (
    SessionSettings,
    build_session,
    check_signature,
    choose_precision,
    convert,
    require_provider,
    thread_share,
)

__all__ = [
    "BatchTiming",
    "DynamicBatcher",
    "IndexEntry",
    "ModelBundle",
    "ModelRepository",
    "ProfileReport",
    "Replica",
    "Served",
    "SessionSettings",
    "WorkerMetrics",
    "batch_cap",
    "batch_ladder",
    "build_session",
    "check_signature",
    "choose_precision",
    "convert",
    "load_bundle",
    "profile_replica",
    "require_provider",
    "synthetic_inputs",
    "thread_share",
    "to_profile",
]
