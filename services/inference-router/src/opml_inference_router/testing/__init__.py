"""Helpers for tests and benches of the router and its workers: models built in code, bundles on disk."""

from opml_inference_router.testing.fleets import CPU_AND_ACCEL, fleet_env
from opml_inference_router.testing.models import (
    external_weights_model,
    mlp_classifier,
    mlp_config,
    write_broken_onnx,
    write_model_dir,
)
from opml_inference_router.testing.processes import front_process, worker_processes

__all__ = ["CPU_AND_ACCEL", "external_weights_model", "fleet_env", "front_process", "mlp_classifier", "mlp_config",
           "worker_processes", "write_broken_onnx", "write_model_dir"]
