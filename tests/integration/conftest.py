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


CALLS = {
    "automl-controller": {"job-orchestrator", "bundle-store", "inference-router"},
    "fl-coordinator": {"bundle-store"},
    "inference-router": {"bundle-store", "monitoring-scorer"},
    "job-orchestrator": {"bundle-store", "monitoring-scorer"},
    "monitoring-scorer": {"bundle-store"},
}
"""The services each service calls (its settings' ``*_target``)."""


@pytest.fixture
def stack_specs():
    """The installed services in an order where each starts after those it calls (:data:`CALLS`), so a
    test that starts them one by one, each told the targets of the earlier ones, gives each what `make up`
    gives it: every target (in name order, the orchestrator would not know the monitoring-scorer whose
    alerts it checks, nor the automl-controller the orchestrator its trials run on)."""
    from opml_devstack.stack import installed_services
    waiting, ordered = sorted(installed_services(), key=lambda spec: spec.name), []
    while waiting:
        started = {spec.name for spec in ordered}
        ready = next(spec for spec in waiting if CALLS.get(spec.name, set()) & {s.name for s in waiting} <= started)
        ordered.append(ready)
        waiting.remove(ready)
    return ordered
