"""Measuring serving configurations on a pool kind with the worker's session code (real onnxruntime)."""

from __future__ import annotations

import onnx
import pytest

from opml_common.errors import FailedPrecondition
from opml_common.perfmodel import ServingConfig
from opml_inference_router.placement import PoolKind
from opml_inference_router.runtime.perfsample import measure, mlp_mflop_per_row
from opml_inference_router.testing.models import mlp_classifier, mlp_config
from opml_inference_router_contract.model_config import ModelConfig

CPU = PoolKind(name="cpu", precisions=("fp32", "int8"), memory_mib=1024, slots=1, cost_per_hour=1.0,
               execution_provider="CPUExecutionProvider")
ACCEL = PoolKind(name="accel", precisions=("int8",), memory_mib=1024, slots=1, cost_per_hour=1.0,
                 execution_provider="CPUExecutionProvider", batch_sizes=(1, 8))


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(mlp_classifier(features=16, width=32, depth=2), path)
    return path, ModelConfig.from_dict(mlp_config("m", features=16))


def test_every_configuration_is_measured_in_the_order_given(model):
    path, config = model
    configs = [ServingConfig(4, 1, "disable", "parallel", "int8"), ServingConfig(1), ServingConfig(2, 2, "basic")]
    samples = measure(path, config, CPU, configs, runs=3, warmup=1, passes=2)
    assert [s.config for s in samples] == configs
    assert all(s.latency_ms > 0 and s.model == "m" for s in samples)
    assert samples[0].mflop_per_row == mlp_mflop_per_row(path) == pytest.approx(2 * (16 * 32 + 32 * 32 + 32 * 4) / 1e6)


def test_a_batch_the_kind_pads_runs_and_a_precision_it_lacks_is_refused(model):
    path, config = model
    (sample,) = measure(path, config, ACCEL, [ServingConfig(3, precision="int8")], runs=3, warmup=1)
    assert sample.config.batch == 3 and sample.latency_ms > 0  # ran as a batch of 8
    with pytest.raises(FailedPrecondition, match="accel runs int8, not fp32"):
        measure(path, config, ACCEL, [ServingConfig(1)])
