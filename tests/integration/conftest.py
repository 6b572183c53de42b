"""Fixtures shared by the integration tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from opml_devstack.process import ServiceProcess
from opml_devstack.testing.services import TOKENS
from opml_inference_router.testing import mlp_config, write_model_dir

ONE_CPU_WORKER = {
    "pool_kinds": [{"name": "cpu", "precisions": ["fp32"], "memory_mib": 2048, "slots": 2, "cost_per_hour": 0.4,
                    "execution_provider": "CPUExecutionProvider"}],
    "pools": [{"name": "cpu", "kind": "cpu", "workers": 1}],
}


@dataclass
class ServingStack:
    """A bundle-store and a router that fetches from it (as a reader), one CPU worker, and an ONNX model's files."""

    store: ServiceProcess
    router: ServiceProcess
    files: dict[str, Path]


@pytest.fixture
def serving_stack(start_service, tmp_path: Path) -> ServingStack:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump(ONE_CPU_WORKER))
    store = start_service("bundle-store")
    router = start_service("inference-router", extra_env={
        "OPML_INFERENCE_ROUTER_FLEET": str(fleet),
        "OPML_INFERENCE_ROUTER_BUNDLE_STORE_TARGET": store.target,
        "OPML_INFERENCE_ROUTER_BUNDLE_STORE_TOKEN": TOKENS["reader"],
        "OPML_INFERENCE_ROUTER_WORKER_THREADS_PER_REPLICA": "1"})
    model_dir = write_model_dir(tmp_path / "mlp", mlp_config("mlp", pool_kinds=("cpu",), precisions=("fp32",)))
    return ServingStack(store, router, {"model.onnx": model_dir / "model.onnx", "model.yaml": model_dir / "model.yaml"})
