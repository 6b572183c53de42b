"""A worker: one process of one pool kind that hosts model replicas behind the KServe v2 gRPC API.

``python -m opml_inference_router.worker --pool-kind <kind> --fleet <fleet.yaml> --port 0`` serves;
:class:`WorkerProcess` starts one from a parent and learns its ports.
"""

from opml_inference_router.worker.process import WorkerProcess

__all__ = ["WorkerProcess"]
