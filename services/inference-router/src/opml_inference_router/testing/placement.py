"""Small fleets, model configs, demands and affine profiles for tests of the placement core and its
policies (the planner's tests and the policy conformance suite share them)."""

from __future__ import annotations

from opml_inference_router.placement import (
    Fleet,
    FleetConfig,
    ModelDemand,
    ModelVersion,
    PoolConfig,
    PoolKind,
    Profile,
    ProfileBook,
)
from opml_inference_router_contract.model_config import DynamicBatching, LatencySlo, ModelConfig, TensorSpec

CPU = PoolKind(name="cpu", precisions=("fp32",), memory_mib=65536, slots=16, cost_per_hour=1.6,
               execution_provider="CPUExecutionProvider")  # 0.10 per replica-hour
GPU = PoolKind(name="gpu", precisions=("fp32", "fp16"), memory_mib=81920, slots=8, cost_per_hour=4.0,
               execution_provider="CUDAExecutionProvider")  # 0.50
ACCEL = PoolKind(name="accel", precisions=("int8",), memory_mib=16384, slots=4, cost_per_hour=1.0,
                 execution_provider="VitisAIExecutionProvider", batch_sizes=(1, 8, 32))  # 0.25
LADDER = (1, 2, 4, 8, 16)


def fleet(*kinds_and_workers: tuple[PoolKind, int], min_replicas: int = 1) -> Fleet:
    """A fleet of these kinds and worker counts. ``min_replicas`` 1 (not the fleet default, 2): the
    replica counts are the policy's own sizing, what most placement tests look at."""
    pools = tuple(PoolConfig(name=kind.name, kind=kind.name, workers=n) for kind, n in kinds_and_workers)
    return Fleet(FleetConfig(pool_kinds=tuple(kind for kind, _ in kinds_and_workers), pools=pools,
                             min_replicas=min_replicas))


def config(name: str, *, rate: float, slo: float = 40.0, kinds=("cpu",), precisions=("fp32",)) -> ModelConfig:
    return ModelConfig(
        name=name, max_batch_size=16, inputs=(TensorSpec(name="x", data_type="fp32", dims=(4,)),),
        outputs=(TensorSpec(name="y", data_type="fp32", dims=(1,)),),
        dynamic_batching=DynamicBatching(max_queue_delay_us=1000),
        slo=LatencySlo(p99_ms=slo), expected_rate_rps=rate, pool_kinds=tuple(kinds), precisions=tuple(precisions),
    )


def demand(name: str, **settings) -> ModelDemand:
    model = config(name, **settings)
    return ModelDemand(model, 1, model.expected_rate_rps)


def profiles(name: str, *, memory: float = 500.0, cpu=(1.0, 4.0), gpu=(2.0, 0.2), accel=(0.3, 0.05)) -> list[Profile]:
    """Affine batch latencies (overhead, per request) on each kind: cpu batches poorly, gpu and accel well."""
    model = ModelVersion(name, 1)
    return [
        Profile(model, "cpu", "fp32", {n: cpu[0] + cpu[1] * n for n in LADDER}, memory),
        Profile(model, "gpu", "fp32", {n: gpu[0] + gpu[1] * n for n in LADDER}, memory),
        Profile(model, "accel", "int8", {n: accel[0] + accel[1] * n for n in (1, 8)}, memory),
    ]


def book(*names: str, **settings) -> ProfileBook:
    return ProfileBook(p for name in names for p in profiles(name, **settings))
