"""The planner places a model version on a kind it lacks a full profile on by the profile a
performance model transfers from another kind (placement.predicted), and only then."""

from __future__ import annotations

import math

import pytest

from opml_inference_router.placement import (
    CostAwareSloPolicy,
    ModelVersion,
    Planner,
    Profile,
    ProfileBook,
    ProfilePredictor,
)
from opml_inference_router.placement.predicted import kind_sizes
from opml_inference_router.testing.placement import ACCEL, CPU, LADDER, demand, fleet

FACTOR, EXPONENT = 0.5, 0.9  # the law the fleet's experience follows: accel = 0.5 x cpu ** 0.9


def cpu_profile(name: str, overhead: float, per_row: float) -> Profile:
    return Profile(ModelVersion(name, 1), "cpu", "fp32", {n: overhead + per_row * n for n in LADDER}, 400.0)


def accel_of(profile: Profile, sizes=(1, 8)) -> Profile:
    return Profile(profile.model, "accel", "int8",
                   {n: FACTOR * profile.latency_ms(n) ** EXPONENT for n in sizes}, profile.memory_mib)


def experience() -> list[Profile]:
    """Two versions measured on both kinds."""
    known = [cpu_profile("a", 1.0, 2.0), cpu_profile("b", 3.0, 0.5)]
    return [*known, *(accel_of(p) for p in known)]


def planners(the_fleet):
    policy = CostAwareSloPolicy()
    return (Planner(fleet=the_fleet, policy=policy),
            Planner(fleet=the_fleet, policy=policy, predictor=ProfilePredictor(fleet=the_fleet)))


HOT = dict(rate=1600, slo=40.0, kinds=("accel", "cpu"), precisions=("fp32", "int8"))


def test_a_partial_profile_is_completed_and_the_batch_cap_comes_from_the_prediction():
    the_fleet = fleet((CPU, 2), (ACCEL, 1))
    new = cpu_profile("new", 2.0, 3.0)
    partial = accel_of(new, sizes=(1,))  # only batch 1 was measured on accel
    book = ProfileBook([*experience(), new, partial])
    plain, predicting = planners(the_fleet)
    model = ModelVersion("new", 1)

    without = plain.plan([demand("new", **HOT)], book).placements[model].option
    assert without.pool_kind == "cpu"  # accel, capped at its one measured batch size, needs too many replicas

    predicted = ProfilePredictor(fleet=the_fleet).predict(demand("new", **HOT), ACCEL, book)
    assert sorted(predicted.batch_latency_ms) == kind_sizes(ACCEL, demand("new", **HOT).config) == [1, 8]
    assert predicted.batch_latency_ms[1] == partial.batch_latency_ms[1]  # measured points stay measured
    assert predicted.latency_ms(8) == pytest.approx(FACTOR * new.latency_ms(8) ** EXPONENT, rel=1e-6)

    placed = predicting.plan([demand("new", **HOT)], book).placements[model].option
    assert (placed.pool_kind, placed.max_batch) == ("accel", 8)
    assert placed.cost_per_hour < without.cost_per_hour
    expected = CostAwareSloPolicy().options(demand("new", **HOT), {"accel": predicted}, the_fleet)[0]
    assert placed.predicted_p99_ms == pytest.approx(expected.predicted_p99_ms)
    assert book.get(model, "accel") is partial  # the prediction lived for that plan only


def test_a_kind_never_profiled_is_predicted_from_the_fleets_experience():
    the_fleet = fleet((CPU, 2), (ACCEL, 1))
    book = ProfileBook([*experience(), cpu_profile("new", 2.0, 1.5)])
    plain, predicting = planners(the_fleet)
    accel_only = demand("new", rate=5, kinds=("accel",), precisions=("fp32", "int8"))
    assert plain.plan([accel_only], book).unplaced[ModelVersion("new", 1)] == (
        "no pool kind can serve it (accel: not profiled)")
    option = predicting.plan([accel_only], book).placements[ModelVersion("new", 1)].option
    assert (option.pool_kind, option.precision) == ("accel", "int8")  # the precision the kind runs


def test_without_experience_of_the_kind_nothing_is_invented():
    the_fleet = fleet((CPU, 2), (ACCEL, 1))
    book = ProfileBook([cpu_profile("a", 1.0, 2.0), cpu_profile("new", 2.0, 1.5)])
    _, predicting = planners(the_fleet)
    plan = predicting.plan([demand("new", rate=5, kinds=("accel",), precisions=("int8",))], book)
    assert plan.unplaced[ModelVersion("new", 1)] == "no pool kind can serve it (accel: not profiled)"


def test_a_full_profile_and_a_model_the_kind_cannot_run_are_left_alone():
    the_fleet = fleet((CPU, 2), (ACCEL, 1))
    book = ProfileBook([*experience(), cpu_profile("new", 2.0, 1.5)])
    predictor = ProfilePredictor(fleet=the_fleet)
    assert predictor.predict(demand("a", **HOT), ACCEL, book) is None  # a is fully profiled on accel
    fp32_only = demand("new", rate=5, kinds=("accel", "cpu"), precisions=("fp32",))
    assert predictor.predict(fp32_only, ACCEL, book) is None
    completed, predicted = predictor.complete([demand("new", **HOT)], book)
    assert predicted == {(ModelVersion("new", 1), "accel")} and len(completed) == len(book) + 1
    assert all(math.isfinite(ms) for ms in completed.get(ModelVersion("new", 1), "accel").batch_latency_ms.values())


def test_a_kind_whose_workers_are_down_is_not_predicted_onto():
    the_fleet = fleet((CPU, 2), (ACCEL, 1))
    book = ProfileBook([*experience(), cpu_profile("new", 2.0, 1.5)])
    down = ProfilePredictor(fleet=the_fleet, serving=lambda kind: kind != "accel")
    _, predicted = down.complete([demand("new", **HOT)], book)
    assert predicted == set()
    plan = Planner(fleet=the_fleet, policy=CostAwareSloPolicy(), predictor=down).plan(
        [demand("new", rate=5, kinds=("accel",), precisions=("int8",))], book)
    assert plan.unplaced[ModelVersion("new", 1)] == "no pool kind can serve it (accel: not profiled)"
