"""A model version served on several pool kinds at once (``instance_groups``): the config's rules,
and the planner that places exactly those groups and keeps them through a worker's loss."""

from __future__ import annotations

import pytest

from opml_common.errors import InvalidArgument
from opml_inference_router.placement import (
    CostAwareSloPolicy,
    Planner,
    Replanner,
    replicas_of,
)
from opml_inference_router.placement.plan import ModelDemand
from opml_inference_router.testing.placement import ACCEL, CPU, book, config, fleet
from opml_inference_router_contract.model_config import InstanceGroup, ModelConfig


def grouped(name: str = "both", *, groups=(("accel", "int8", 1), ("cpu", "fp32", 1)), rate: float = 50.0,
            min_replicas: int | None = None) -> ModelDemand:
    base = config(name, rate=rate, kinds=("accel", "cpu"), precisions=("int8", "fp32"))
    model = base.model_copy(update={
        "instance_groups": tuple(InstanceGroup(pool_kind=k, precision=p, count=n) for k, p, n in groups),
        "min_replicas": min_replicas})
    return ModelDemand(model, 1, rate)


def raw(**changes) -> dict:
    return {"name": "m", "max_batch_size": 4, "inputs": [{"name": "x", "data_type": "fp32", "dims": [3]}],
            "outputs": [{"name": "y", "data_type": "fp32"}], "slo": {"p99_ms": 50.0}, "expected_rate_rps": 10.0,
            "pool_kinds": ["accel", "cpu"], "precisions": ["int8", "fp32"], **changes}


# -- the config ----------------------------------------------------------------------------------


def test_groups_parse_with_a_default_count_and_are_optional() -> None:
    config_ = ModelConfig.from_dict(raw(instance_groups=[{"pool_kind": "accel", "precision": "int8"},
                                                         {"pool_kind": "cpu", "precision": "fp32", "count": 2}]))
    assert config_.instance_groups == (InstanceGroup(pool_kind="accel", precision="int8", count=1),
                                       InstanceGroup(pool_kind="cpu", precision="fp32", count=2))
    assert ModelConfig.from_dict(raw()).instance_groups is None


def test_every_wrong_group_field_is_named_with_its_path() -> None:
    with pytest.raises(InvalidArgument) as error:
        ModelConfig.from_dict(raw(min_replicas=4, instance_groups=[
            {"pool_kind": "gpu", "precision": "fp16"}, {"pool_kind": "cpu", "precision": "bf16"},
            {"pool_kind": "gpu", "precision": "fp16"}]))
    assert error.value.field == "instance_groups[0].pool_kind"
    for named in ("instance_groups[0].precision", "instance_groups[1].precision", "instance_groups[2].pool_kind",
                  "instance_groups[2] groups must differ", "sum to 3, below min_replicas 4"):
        assert named in error.value.message


@pytest.mark.parametrize(("groups", "field"), [
    ([{"pool_kind": "cpu", "precision": "fp32", "count": 0}], "instance_groups[0].count"),
    ([], "instance_groups"),
    ([{"pool_kind": "cpu", "precision": "fp32", "replicas": 1}], "instance_groups[0].replicas"),
])
def test_a_group_breaking_a_field_rule_is_refused(groups, field) -> None:
    with pytest.raises(InvalidArgument) as error:
        ModelConfig.from_dict(raw(instance_groups=groups))
    assert error.value.field == field


# -- the planner ---------------------------------------------------------------------------------


def test_each_group_gets_its_count_on_distinct_workers_of_its_kind() -> None:
    the_fleet = fleet((CPU, 3), (ACCEL, 2), min_replicas=2)
    both = grouped(groups=(("accel", "int8", 1), ("cpu", "fp32", 2)))
    plan = Planner(fleet=the_fleet, policy=CostAwareSloPolicy()).plan([both], book("both"))
    placed = plan.placements[both.model]
    kinds = [(part.option.pool_kind, part.option.precision, len(set(part.workers))) for part in placed.parts()]
    assert kinds == [("accel", "int8", 1), ("cpu", "fp32", 2)]  # exact counts, not the fleet's floor of 2 each
    assert not placed.short
    replicas = replicas_of(plan)
    assert sorted((r.pool_kind, r.precision) for r in replicas) == [("accel", "int8"), ("cpu", "fp32"),
                                                                    ("cpu", "fp32")]
    assert plan.cost_per_hour == pytest.approx(sum(p.option.cost_per_hour for p in placed.parts()))


def test_without_groups_the_version_goes_on_one_kind() -> None:
    the_fleet = fleet((CPU, 3), (ACCEL, 2))
    single = ModelDemand(config("one", rate=50.0, kinds=("accel", "cpu"), precisions=("int8", "fp32")), 1, 50.0)
    placed = Planner(fleet=the_fleet, policy=CostAwareSloPolicy()).plan([single], book("one")).placements[single.model]
    assert placed.groups == () and len({placed.option.pool_kind}) == 1


def test_what_does_not_fit_is_placed_short_and_said() -> None:
    the_fleet = fleet((CPU, 2), (ACCEL, 1))
    both = grouped(groups=(("accel", "int8", 2), ("cpu", "fp32", 1)))
    plan = Planner(fleet=the_fleet, policy=CostAwareSloPolicy()).plan([both], book("both", memory=10000.0))
    placed = plan.placements[both.model]  # one 16 GiB accel worker holds one 10 GiB replica
    assert [len(part.workers) for part in placed.parts()] == [1, 1]
    assert "accel/int8: 1 of 2" in placed.short


def test_a_group_in_a_precision_its_kind_does_not_run_is_refused() -> None:
    the_fleet = fleet((CPU, 2), (ACCEL, 1))
    wrong = grouped(groups=(("accel", "fp32", 1),))
    with pytest.raises(InvalidArgument) as error:
        Planner(fleet=the_fleet, policy=CostAwareSloPolicy()).plan([wrong], book("both"))
    assert error.value.field == "demands[0].config.instance_groups[0].precision"


def test_a_lost_worker_is_replaced_within_its_group_and_grows_back() -> None:
    the_fleet = fleet((CPU, 3), (ACCEL, 2))
    lost: set[str] = set()
    planner = Planner(fleet=the_fleet, policy=CostAwareSloPolicy(),
                      usable=lambda demand, worker: "host lost" if worker.id in lost else "")
    replanner = Replanner(planner=planner)
    both = grouped(groups=(("accel", "int8", 1), ("cpu", "fp32", 2)))
    profiles = book("both")
    plan = planner.plan([both], profiles)
    cpu_before = plan.placements[both.model].groups[0].workers
    lost.add(cpu_before[0])
    replan = replanner.replan(plan, [both], profiles, {})
    placed = replan.plan.placements[both.model]
    cpu = placed.groups[0]
    assert (cpu.option.pool_kind, len(cpu.workers)) == ("cpu", 2) and cpu_before[0] not in cpu.workers
    assert cpu_before[1] in cpu.workers  # the replica on a live worker stays where it is
    assert placed.option.pool_kind == "accel" and placed.workers == plan.placements[both.model].workers
    assert "host lost" in replan.reasons[both.model]

    # no cpu worker left with room for the second replica: short, then grows back once one returns
    lost.update(w.id for w in the_fleet.workers_of("cpu") if w.id not in cpu.workers[:1])
    replan = replanner.replan(replan.plan, [both], profiles, {})
    short = replan.plan.placements[both.model]
    assert len(short.groups[0].workers) == 1 and "cpu/fp32: 1 of 2" in short.short
    lost.clear()
    grown = replanner.replan(replan.plan, [both], profiles, {}, regrow=True).plan.placements[both.model]
    assert len(grown.groups[0].workers) == 2 and not grown.short


def test_a_grouped_version_is_kept_as_it_is_when_nothing_changed() -> None:
    the_fleet = fleet((CPU, 3), (ACCEL, 2))
    planner = Planner(fleet=the_fleet, policy=CostAwareSloPolicy())
    both = grouped()
    profiles = book("both")
    plan = planner.plan([both], profiles)
    replan = Replanner(planner=planner).replan(plan, [both], profiles, {}, regrow=True)
    assert replan.moves == () and replan.plan.placements == plan.placements
    assert both.model not in replan.reasons
