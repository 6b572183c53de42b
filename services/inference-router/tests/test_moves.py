"""Capacity-safe moves between hand-built plans, and the checker that replays them."""

from __future__ import annotations

import pytest

from opml_common.errors import FailedPrecondition
from opml_inference_router.placement import (
    AddReplica,
    Fleet,
    FleetConfig,
    ModelVersion,
    Option,
    Plan,
    PoolConfig,
    PoolKind,
    RemoveReplica,
    Replica,
    ReplicaSet,
    ResizeReplica,
    WaitReady,
    check_moves,
    plan_moves,
    replicas_of,
)

A, B = ModelVersion("a", 1), ModelVersion("b", 1)


def fleet(workers: int, *, slots: int = 1) -> Fleet:
    kind = PoolKind(name="cpu", precisions=("fp32",), memory_mib=1000, slots=slots, cost_per_hour=1.0,
                    execution_provider="CPUExecutionProvider")
    return Fleet(FleetConfig(pool_kinds=(kind,), pools=(PoolConfig(name="w", kind="cpu", workers=workers),)))


def placed(model: ModelVersion, *workers: str, batch: int = 8, capacity: float = 100.0,
           memory: float = 400.0) -> ReplicaSet:
    option = Option("cpu", "fp32", batch, 1.0, len(workers), capacity, 5.0, memory, 0.1 * len(workers))
    return ReplicaSet(model, option, workers, capacity * len(workers) * 0.5)


def plan(*replica_sets: ReplicaSet) -> Plan:
    return Plan({replica_set.model: replica_set for replica_set in replica_sets})


def names(actions) -> list[str]:
    out = []
    for action in actions:
        if isinstance(action, WaitReady):
            out.append("wait " + ",".join(f"{r.model.name}@{r.worker}" for r in action.replicas))
        elif isinstance(action, ResizeReplica):
            old, new = action.old, action.new
            out.append(f"resize {old.model.name}@{old.worker} {old.max_batch}->{new.max_batch}")
        else:
            verb = "add" if isinstance(action, AddReplica) else "remove"
            out.append(f"{verb} {action.replica.model.name}@{action.replica.worker}")
    return out


def test_a_move_adds_and_waits_before_it_removes() -> None:
    the_fleet = fleet(3)
    before, after = plan(placed(A, "w-000")), plan(placed(A, "w-001"))
    moves = plan_moves(before, after, the_fleet)
    assert names(moves) == ["add a@w-001", "wait a@w-001", "remove a@w-000"]
    check_moves(before, after, moves, the_fleet)


def test_a_swap_between_full_workers_goes_through_a_temporary_replica() -> None:
    the_fleet = fleet(3)  # one slot each; w-002 is free
    before = plan(placed(A, "w-000"), placed(B, "w-001"))
    after = plan(placed(A, "w-001"), placed(B, "w-000"))
    moves = plan_moves(before, after, the_fleet)
    assert names(moves) == [
        "add a@w-002", "wait a@w-002", "remove a@w-000",  # a's stand-in frees w-000 without a gap
        "add b@w-000", "wait b@w-000", "remove b@w-001",
        "add a@w-001", "wait a@w-001", "remove a@w-002",  # the stand-in goes last
    ]
    check_moves(before, after, moves, the_fleet)


def test_a_swap_with_no_room_anywhere_is_refused() -> None:
    before = plan(placed(A, "w-000"), placed(B, "w-001"))
    after = plan(placed(A, "w-001"), placed(B, "w-000"))
    with pytest.raises(FailedPrecondition, match="no worker has room for a temporary copy"):
        plan_moves(before, after, fleet(2))


def test_scaling_in_removes_down_to_the_new_capacity_only() -> None:
    the_fleet = fleet(3)
    before, after = plan(placed(A, "w-000", "w-001", "w-002")), plan(placed(A, "w-000"))
    moves = plan_moves(before, after, the_fleet)
    assert names(moves) == ["remove a@w-001", "remove a@w-002"]
    check_moves(before, after, moves, the_fleet)


def test_a_new_batch_cap_on_a_full_single_slot_worker_is_a_resize_in_place() -> None:
    the_fleet = fleet(1, slots=1)  # the accelerator case: no room for a second copy
    before, after = plan(placed(A, "w-000", batch=8)), plan(placed(A, "w-000", batch=16, capacity=150.0))
    moves = plan_moves(before, after, the_fleet)
    assert names(moves) == ["resize a@w-000 8->16"]
    check_moves(before, after, moves, the_fleet)


def test_a_new_precision_on_the_same_worker_loads_beside_the_old_replica() -> None:
    the_fleet = fleet(1, slots=2)
    before = plan(placed(A, "w-000", batch=8))
    int8 = Option("cpu", "int8", 8, 1.0, 1, 100.0, 5.0, 400.0, 0.1)
    after = Plan({A: ReplicaSet(A, int8, ("w-000",), 50.0)})
    moves = plan_moves(before, after, the_fleet)
    assert [type(action) for action in moves] == [AddReplica, WaitReady, RemoveReplica]
    assert moves[0].replica.precision == "int8" and moves[2].replica.precision == "fp32"
    check_moves(before, after, moves, the_fleet)


def test_resizes_that_lose_capacity_wait_for_the_new_replicas_and_capacity_never_drops() -> None:
    the_fleet = fleet(3)
    before = plan(placed(A, "w-000", "w-001", batch=8, capacity=100.0))  # 200 rps
    after = plan(placed(A, "w-000", "w-001", "w-002", batch=4, capacity=70.0))  # 210 rps
    moves = plan_moves(before, after, the_fleet)
    assert names(moves) == ["add a@w-002", "wait a@w-002", "resize a@w-000 8->4", "resize a@w-001 8->4"]
    check_moves(before, after, moves, the_fleet)
    ready = 200.0  # replayed by hand as well: never below min(200, 210)
    for action in moves:
        if isinstance(action, WaitReady):
            ready += sum(r.capacity_rps for r in action.replicas)
        elif isinstance(action, ResizeReplica):
            ready += action.new.capacity_rps - action.old.capacity_rps
        assert ready >= 200.0
    resizes_first = (ResizeReplica(replicas_of(before)[0], replicas_of(after)[0]), *moves[:2], moves[3])
    with pytest.raises(FailedPrecondition, match=r"step 0 \(ResizeReplica\).*170.0 rps of ready capacity, below 200.0"):
        check_moves(before, after, resizes_first, the_fleet)


def test_a_resize_that_gains_capacity_goes_before_one_that_loses_it() -> None:
    the_fleet = fleet(2)
    before = plan(placed(A, "w-000", batch=8, capacity=100.0), placed(B, "w-001", batch=8, capacity=100.0))
    after = plan(placed(A, "w-000", batch=2, capacity=60.0), placed(B, "w-001", batch=32, capacity=300.0))
    moves = plan_moves(before, after, the_fleet)
    assert names(moves) == ["resize b@w-001 8->32", "resize a@w-000 8->2"]
    check_moves(before, after, moves, the_fleet)


def test_the_checker_refuses_a_resize_into_another_worker_or_beyond_memory() -> None:
    the_fleet = fleet(2)
    before, after = plan(placed(A, "w-000")), plan(placed(A, "w-001", batch=16))
    old, new = replicas_of(before)[0], replicas_of(after)[0]
    with pytest.raises(FailedPrecondition, match=r"step 0 \(ResizeReplica\).*not the same loaded replica"):
        check_moves(before, after, (ResizeReplica(old, new),), the_fleet)
    grown = plan(placed(A, "w-000", batch=16, memory=1200.0))
    with pytest.raises(FailedPrecondition, match="cannot re-size models/a/versions/1 on w-000 in place"):
        plan_moves(before, grown, the_fleet)


def test_replicas_of_one_model_on_one_worker_are_told_apart() -> None:
    replicas = replicas_of(plan(placed(A, "w-000", "w-000", "w-001")))
    assert [(r.worker, r.index) for r in replicas] == [("w-000", 0), ("w-000", 1), ("w-001", 0)]


def test_the_checker_names_the_first_unsafe_step() -> None:
    the_fleet = fleet(2)
    before, after = plan(placed(A, "w-000")), plan(placed(A, "w-001"))
    old, new = replicas_of(before)[0], replicas_of(after)[0]
    gap = (RemoveReplica(old), AddReplica(new), WaitReady((new,)))
    with pytest.raises(FailedPrecondition, match=r"step 0 \(RemoveReplica\).*0.0 rps of ready capacity, below 100.0"):
        check_moves(before, after, gap, the_fleet)
    unready = (AddReplica(new), RemoveReplica(new))
    with pytest.raises(FailedPrecondition, match=r"step 1 \(RemoveReplica\).*not a ready replica"):
        check_moves(before, after, unready, the_fleet)
    crowded = Replica(A, "w-000", 1, "cpu", "fp32", 8, 400.0, 100.0)
    with pytest.raises(FailedPrecondition, match=r"step 0 \(AddReplica\).*does not fit on worker w-000"):
        check_moves(before, after, (AddReplica(crowded),), the_fleet)
    with pytest.raises(FailedPrecondition, match="missing"):
        check_moves(before, after, (), the_fleet)
