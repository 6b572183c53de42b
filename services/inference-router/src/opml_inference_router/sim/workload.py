"""A synthetic fleet and model population for the placement simulator.

Three pool kinds, declared like any deployment declares them: ``cpu`` (fp32, 16 slots, cheap per
slot, poor batching), ``gpu`` (fp32/fp16, 8 slots, dear per slot, strong batching behind a fixed
launch overhead) and ``accel`` (FPGA-style: int8 only, 4 slots, 16 GiB, fixed batch shapes 1/8/32,
fast and cheap per request). Models differ in size, memory, batching, allowed kinds and precisions,
SLO and rate; rates follow a Zipf law over a random order, so popularity says nothing about
position in the deploy order.

Each model has a *true* profile per allowed kind (what its replicas really do, which the
discrete-event check runs) and a *measured* one (the truth times log-normal noise per batch size,
which is all the planner sees).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from opml_inference_router.placement.fleet import Fleet
from opml_inference_router.placement.fleet_config import FleetConfig, ModelVersion, PoolConfig, PoolKind
from opml_inference_router.placement.plan import ModelDemand
from opml_inference_router.placement.profile import Profile, ProfileBook
from opml_inference_router_contract.model_config import DynamicBatching, LatencySlo, ModelConfig, TensorSpec

POOL_KINDS = (
    PoolKind(name="cpu", precisions=("fp32",), memory_mib=65536, slots=16, cost_per_hour=1.6,
             execution_provider="CPUExecutionProvider"),
    PoolKind(name="gpu", precisions=("fp32", "fp16"), memory_mib=81920, slots=8, cost_per_hour=4.0,
             execution_provider="CUDAExecutionProvider"),
    PoolKind(name="accel", precisions=("int8",), memory_mib=16384, slots=4, cost_per_hour=1.0,
             execution_provider="VitisAIExecutionProvider", batch_sizes=(1, 8, 32)),
)
WORKER_SHARES = {"cpu": 0.6, "gpu": 0.2, "accel": 0.2}


@dataclass(frozen=True)
class Workload:
    """A fleet, what is asked of it, what profiling measured and what is really true."""

    fleet: Fleet
    demands: tuple[ModelDemand, ...]
    profiles: ProfileBook
    truth: ProfileBook


def synthetic_fleet(workers: int = 200) -> Fleet:
    """``workers`` split 60/20/20 across cpu, gpu and accel pools."""
    counts = {name: int(workers * share) for name, share in WORKER_SHARES.items()}
    counts["cpu"] += workers - sum(counts.values())
    return Fleet(FleetConfig(pool_kinds=POOL_KINDS,
                             pools=tuple(PoolConfig(name=name, kind=name, workers=n) for name, n in counts.items())))


def synthetic_workload(*, seed: int, models: int = 1000, workers: int = 200, total_rate_rps: float = 100_000.0,
                       zipf_exponent: float = 1.0, profile_noise: float = 0.08) -> Workload:
    """A reproducible workload: the same arguments give the same workload."""
    rng = random.Random(seed)
    fleet = synthetic_fleet(workers)
    weights = [1.0 / rank**zipf_exponent for rank in range(1, models + 1)]
    rng.shuffle(weights)
    scale = total_rate_rps / sum(weights)
    demands, measured, truth = [], [], []
    for index in range(models):
        config, true_profiles = _model(rng, f"model-{index:04d}", weights[index] * scale)
        demands.append(ModelDemand(config, 1, config.expected_rate_rps))
        truth.extend(true_profiles)
        measured.extend(_measure(rng, profile, profile_noise) for profile in true_profiles)
    return Workload(fleet, tuple(demands), ProfileBook(measured), ProfileBook(truth))


def _log_uniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def _model(rng: random.Random, name: str, rate_rps: float) -> tuple[ModelConfig, list[Profile]]:
    work_ms = _log_uniform(rng, 0.3, 8.0)  # one request on one cpu slot
    memory_mib = _log_uniform(rng, 64, 3072)
    max_batch = rng.choice([0, 1, 8, 16, 32, 32, 64])
    delay_us = rng.choice([500, 1000, 2000])
    precisions = ["fp32"] + (["fp16"] if rng.random() < 0.5 else []) + (["int8"] if rng.random() < 0.6 else [])
    kinds = [kind for kind, chance in (("cpu", 0.9), ("gpu", 0.5), ("accel", 0.7))
             if rng.random() < chance and (kind != "accel" or "int8" in precisions)] or ["cpu"]
    rng.shuffle(kinds)
    limit = max(1, max_batch)
    version = ModelVersion(name, 1)
    profiles = []
    for kind in kinds:
        efficiency = _log_uniform(rng, 0.7, 1.4)
        if kind == "cpu":
            sizes, precision = _ladder(limit), "fp32"
            latency = {n: efficiency * work_ms * (0.3 + 0.7 * n) for n in sizes}
            memory = memory_mib
        elif kind == "gpu":
            sizes, precision = _ladder(limit), "fp16" if "fp16" in precisions else "fp32"
            speed = 0.6 if precision == "fp16" else 1.0
            latency = {n: efficiency * speed * (0.8 + 0.1 * work_ms + 0.02 * work_ms * n) for n in sizes}
            memory = memory_mib * 1.2
        else:
            sizes, precision = [shape for shape in (1, 8, 32) if shape <= limit], "int8"
            latency = {n: efficiency * (0.25 + 0.012 * work_ms * n) for n in sizes}
            memory = memory_mib * 0.4 + 64
        profiles.append(Profile(version, kind, precision, latency, memory))
    reference = next((p for p in profiles if p.pool_kind == "cpu"), profiles[0]).latency_ms(1)
    delay_ms = delay_us / 1000 if max_batch > 1 else 0.0
    config = ModelConfig(
        name=name,
        max_batch_size=max_batch,
        inputs=(TensorSpec(name="features", data_type="fp32", dims=(-1, 64)),),
        outputs=(TensorSpec(name="scores", data_type="fp32", dims=(8,)),),
        dynamic_batching=DynamicBatching(max_queue_delay_us=delay_us) if max_batch > 1 else None,
        slo=LatencySlo(p99_ms=round(delay_ms + _log_uniform(rng, 2.0, 8.0) * reference, 3)),
        expected_rate_rps=round(rate_rps, 3),
        pool_kinds=tuple(kinds),
        precisions=tuple(precisions),
    )
    return config, profiles


def _ladder(limit: int) -> list[int]:
    """Batch sizes a profiler measures: powers of two up to the model's limit, and the limit."""
    sizes = [1 << power for power in range(limit.bit_length()) if 1 << power <= limit]
    return sizes if sizes[-1] == limit else [*sizes, limit]


def _measure(rng: random.Random, truth: Profile, noise: float) -> Profile:
    """What profiling reports: each batch size's latency off by log-normal noise (kept non-decreasing)."""
    measured, floor = {}, 0.0
    for size, latency in truth.batch_latency_ms.items():
        floor = max(floor, latency * math.exp(rng.gauss(0.0, noise)))
        measured[size] = floor
    return Profile(truth.model, truth.pool_kind, truth.precision, measured, truth.memory_mib)
