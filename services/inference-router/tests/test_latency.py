"""Profiles and the latency model: sane shapes, and agreement with a request-level simulation."""

from __future__ import annotations

import math
import random

import pytest

from opml_common.errors import AlreadyExists, InvalidArgument
from opml_inference_router.placement import (
    Batching,
    BatchQueueModel,
    ModelVersion,
    PoolKind,
    Profile,
    ProfileBook,
    ServiceCurve,
    batch_caps,
    calibration_factor,
)
from opml_inference_router.sim import simulate_replica

MODEL = ModelVersion("m", 1)
SIZES = (1, 2, 4, 8, 16, 32)
CPU = PoolKind(name="cpu", precisions=("fp32",), memory_mib=65536, slots=16, cost_per_hour=1.6,
               execution_provider="CPUExecutionProvider")
ACCEL = PoolKind(name="accel", precisions=("int8",), memory_mib=16384, slots=4, cost_per_hour=1.0,
                 execution_provider="VitisAIExecutionProvider", batch_sizes=(1, 8, 32))


def affine(overhead_ms: float, per_request_ms: float, kind: PoolKind = CPU) -> ServiceCurve:
    """A profile whose batch of n takes overhead + n x per_request (what batching hardware looks like)."""
    sizes = kind.batch_sizes or SIZES
    precision = kind.precisions[0]
    profile = Profile(MODEL, kind.name, precision, {n: overhead_ms + per_request_ms * n for n in sizes}, 100)
    return ServiceCurve(profile, kind)


MODEL_UNDER_TEST = BatchQueueModel()
CURVES = {
    "cpu-like": affine(1.2, 2.8),
    "gpu-like": affine(1.5, 0.1),
    "accel": affine(0.3, 0.05, ACCEL),
}


# -- profiles ------------------------------------------------------------------------------------


def test_profile_interpolates_and_refuses_unmeasured_sizes() -> None:
    profile = Profile(MODEL, "cpu", "fp32", {1: 2.0, 4: 5.0}, 512)
    assert profile.latency_ms(1) == 2.0 and profile.latency_ms(2) == 3.0 and profile.latency_ms(4) == 5.0
    assert profile.max_batch == 4
    with pytest.raises(InvalidArgument, match=r"within 1..4 .* but got 5"):
        profile.latency_ms(5)
    assert profile.scaled(2.0).latency_ms(2) == 6.0


@pytest.mark.parametrize(
    ("latencies", "memory", "field"),
    [
        ({}, 1, "batch_latency_ms"),
        ({1: 2.0, 2: 1.0}, 1, "batch_latency_ms[2]"),
        ({1: -1.0}, 1, "batch_latency_ms[1]"),
        ({0: 1.0}, 1, "batch_latency_ms[0]"),
        ({1: 1.0}, 0, "memory_mib"),
    ],
)
def test_a_bad_profile_names_the_field(latencies, memory, field) -> None:
    with pytest.raises(InvalidArgument) as caught:
        Profile(MODEL, "cpu", "fp32", latencies, memory)
    assert caught.value.field == field


def test_profiles_round_trip_and_are_stored_once_per_model_and_kind() -> None:
    book = ProfileBook([Profile(MODEL, "cpu", "fp32", {1: 2.0, 8: 9.5}, 300),
                        Profile(MODEL, "accel", "int8", {1: 0.4}, 90)])
    again = ProfileBook.from_dict(book.to_dict())
    assert again.get(MODEL, "cpu") == book.get(MODEL, "cpu") and len(again) == 2
    with pytest.raises(AlreadyExists):
        again.add(Profile(MODEL, "cpu", "fp32", {1: 3.0}, 300))
    again.add(Profile(MODEL, "cpu", "fp32", {1: 3.0}, 300), replace=True)
    assert again.get(MODEL, "cpu").latency_ms(1) == 3.0
    with pytest.raises(InvalidArgument) as caught:
        Profile.from_dict({"model": "m", "version": 1, "pool_kind": "cpu", "precision": "fp32", "memory_mib": 1})
    assert caught.value.field == "batch_latency_ms"


def test_batch_caps_follow_fixed_shapes_and_the_model_limit() -> None:
    assert batch_caps(CPU, 12, CURVES["cpu-like"].profile) == [1, 2, 4, 8, 12]
    assert batch_caps(ACCEL, 16, CURVES["accel"].profile) == [1, 8]
    assert batch_caps(ACCEL, 64, CURVES["accel"].profile) == [1, 8, 32]


# -- the latency model ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CURVES))
@pytest.mark.parametrize("cap", [1, 8, 32])
def test_p99_grows_with_rate_when_batches_do_not_wait(name: str, cap: int) -> None:
    service, batching = CURVES[name], Batching(cap, 0.0)
    capacity = MODEL_UNDER_TEST.capacity_rps(service, batching)
    p99s = [MODEL_UNDER_TEST.p99_ms(service, batching, capacity * i / 50) for i in range(50)]
    assert all(later >= earlier for earlier, later in zip(p99s, p99s[1:]))
    assert p99s[-1] > 1.5 * p99s[0]
    assert MODEL_UNDER_TEST.p99_ms(service, batching, capacity) == math.inf


def test_batching_raises_throughput() -> None:
    service = CURVES["gpu-like"]
    single, batched = Batching(1, 1.0), Batching(32, 1.0)
    assert MODEL_UNDER_TEST.capacity_rps(service, batched) > 10 * MODEL_UNDER_TEST.capacity_rps(service, single)
    slo = 20.0
    assert MODEL_UNDER_TEST.max_rate_rps(service, batched, slo) > 5 * MODEL_UNDER_TEST.max_rate_rps(
        service, single, slo)


def test_max_rate_holds_at_every_lower_rate_even_where_batching_makes_p99_dip() -> None:
    service, batching = CURVES["accel"], Batching(8, 8.0)  # a long queue delay: waits shrink as traffic grows
    for target in (9.0, 10.0, 12.0):
        best = MODEL_UNDER_TEST.max_rate_rps(service, batching, target)
        assert best > 0
        assert all(MODEL_UNDER_TEST.p99_ms(service, batching, best * i / 200) <= target for i in range(201))
    assert MODEL_UNDER_TEST.max_rate_rps(service, batching, 1.0) == 0.0  # a lone request already misses


def test_calibration_recovers_a_slowdown() -> None:
    service, batching = CURVES["cpu-like"], Batching(8, 1.0)
    slower = ServiceCurve(service.profile.scaled(1.7), CPU)
    measured = MODEL_UNDER_TEST.p99_ms(slower, batching, 150.0)
    assert calibration_factor(MODEL_UNDER_TEST, service, batching, 150.0, measured) == pytest.approx(1.7, rel=1e-3)
    faster = MODEL_UNDER_TEST.p99_ms(service, batching, 150.0) / 2
    assert calibration_factor(MODEL_UNDER_TEST, service, batching, 150.0, faster) == 1.0  # only slow-downs are learnt


@pytest.mark.parametrize(
    ("name", "cap", "delay_ms", "load"),
    [
        ("cpu-like", 1, 0.0, 0.6),
        ("cpu-like", 8, 2.0, 0.3),
        ("gpu-like", 32, 1.0, 0.2),
        ("gpu-like", 32, 1.0, 0.8),
        ("accel", 32, 0.5, 0.7),
    ],
)
def test_the_model_is_close_to_and_mostly_above_a_simulated_replica(name, cap, delay_ms, load) -> None:
    """The independent check: the discrete-event simulation of the same batching discipline."""
    service, batching = CURVES[name], Batching(cap, delay_ms)
    rate = load * MODEL_UNDER_TEST.capacity_rps(service, batching)
    predicted = MODEL_UNDER_TEST.p99_ms(service, batching, rate)
    run = simulate_replica(service.ms, max_batch=cap, queue_delay_ms=delay_ms, rate_rps=rate, requests=20000,
                           warmup=1000, rng=random.Random(7))
    assert 0.9 <= predicted / run.p99_ms <= 1.6
