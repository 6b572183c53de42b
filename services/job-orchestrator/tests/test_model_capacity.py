"""Job specs check themselves; the cluster accounts capacity exactly and rejects what can never run."""

from __future__ import annotations

import pytest

from opml_common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from opml_job_orchestrator.scheduler import (
    Cluster,
    JobClass,
    JobSpec,
    NodeSpec,
    Resources,
    RoleSpec,
    Scheduler,
    fifo_policy,
    te_be_plus_policy,
)

GPU_NODE = Resources(cpu_millis=64_000, memory_mib=512 * 1024, gpu=8)


def per_gpu(gpus: int) -> Resources:
    return Resources(cpu_millis=4_000 * max(gpus, 1), memory_mib=32 * 1024 * max(gpus, 1), gpu=gpus)


def gpu_cluster(nodes: int = 2) -> Cluster:
    return Cluster([NodeSpec(f"n{i}", GPU_NODE) for i in range(nodes)])


def spec(job_id: str = "job", **roles: RoleSpec) -> JobSpec:
    return JobSpec(job_id=job_id, job_class=JobClass.BE, roles=roles or {"chief": RoleSpec(1, per_gpu(1))})


# -- specs ---------------------------------------------------------------------------------------


def test_spec_lists_replicas_in_role_order_and_totals_them() -> None:
    job = spec(worker=RoleSpec(2, per_gpu(4)), chief=RoleSpec(1, per_gpu(2)), ps=RoleSpec(1, per_gpu(0)))
    assert [(r.role, r.index) for r in job.replicas] == [("chief", 0), ("worker", 0), ("worker", 1), ("ps", 0)]
    assert job.total == per_gpu(2) + per_gpu(4) * 2 + per_gpu(0)
    assert job.total.gpu == 10


@pytest.mark.parametrize(("kwargs", "field", "shown"), [
    ({"job_id": "Bad ID"}, "job_id", "'Bad ID'"),
    ({"roles": {}}, "roles", "{}"),
    ({"roles": {"driver": RoleSpec(1, per_gpu(1))}}, "roles.driver", "'driver'"),
    ({"roles": {"worker": RoleSpec(0, per_gpu(1))}}, "roles.worker.replicas", "0"),
    ({"roles": {"chief": RoleSpec(2, per_gpu(1))}}, "roles.chief.replicas", "2"),
    ({"roles": {"worker": RoleSpec(1, Resources(gpu=-1))}}, "roles.worker.resources.gpu", "-1"),
    ({"roles": {"worker": RoleSpec(1, Resources())}}, "roles.worker.resources", "0"),
    ({"checkpoint_interval_s": 0}, "checkpoint_interval_s", "0"),
    ({"restart_overhead_s": float("nan")}, "restart_overhead_s", "nan"),
    ({"priority": 1.5}, "priority", "1.5"),
])
def test_invalid_spec_names_the_field_and_shows_the_value(kwargs: dict, field: str, shown: str) -> None:
    fields = {"job_id": "job", "job_class": JobClass.TE, "roles": {"chief": RoleSpec(1, per_gpu(1))}, **kwargs}
    with pytest.raises(InvalidArgument) as raised:
        JobSpec(**fields)
    assert raised.value.field == field
    assert shown in raised.value.message


# -- capacity accounting -------------------------------------------------------------------------


def test_allocation_and_release_account_every_resource_exactly() -> None:
    cluster = gpu_cluster(2)
    cluster.allocate("a", [("n0", per_gpu(3)), ("n0", per_gpu(2)), ("n1", per_gpu(8))])
    assert cluster.free["n0"] == GPU_NODE - per_gpu(5)
    assert cluster.free["n1"] == GPU_NODE - per_gpu(8)
    assert cluster.total_free == GPU_NODE * 2 - per_gpu(5) - per_gpu(8)
    cluster.allocate("b", [("n0", per_gpu(3))])
    assert cluster.release("a") == (("n0", per_gpu(3)), ("n0", per_gpu(2)), ("n1", per_gpu(8)))
    cluster.release("b")
    assert dict(cluster.free) == {"n0": GPU_NODE, "n1": GPU_NODE}
    assert cluster.total_free == cluster.total_capacity == GPU_NODE * 2


def test_allocation_is_all_or_nothing() -> None:
    cluster = gpu_cluster(2)
    cluster.allocate("a", [("n0", per_gpu(6))])
    with pytest.raises(FailedPrecondition, match="n0"):
        cluster.allocate("b", [("n1", per_gpu(4)), ("n0", per_gpu(1)), ("n0", per_gpu(2))])
    assert cluster.free["n1"] == GPU_NODE and cluster.allocation("b") is None
    with pytest.raises(AlreadyExists):
        cluster.allocate("a", [("n1", per_gpu(1))])
    with pytest.raises(NotFound, match="n9"):
        cluster.allocate("c", [("n9", per_gpu(1))])
    with pytest.raises(NotFound, match="'c'"):
        cluster.release("c")


def test_cluster_rejects_duplicate_node_names() -> None:
    with pytest.raises(InvalidArgument) as raised:
        Cluster([NodeSpec("n0", GPU_NODE), NodeSpec("n0", GPU_NODE)])
    assert raised.value.field == "nodes[1].name"


# -- requests larger than the cluster ------------------------------------------------------------


@pytest.mark.parametrize(("roles", "field", "numbers"), [
    ({"worker": RoleSpec(1, Resources(cpu_millis=1000, gpu=16))}, "roles.worker.resources.gpu", ["16", "8"]),
    ({"chief": RoleSpec(1, Resources(memory_mib=600 * 1024))}, "roles.chief.resources.memory_mib",
     ["614400", "524288"]),
    ({"chief": RoleSpec(1, per_gpu(8)), "worker": RoleSpec(2, per_gpu(8))}, "roles.worker.replicas",
     ["24 gpu", "16"]),
    ({"worker": RoleSpec(3, per_gpu(5))}, "roles", ["cannot be packed"]),
])
def test_submit_rejects_a_job_the_empty_cluster_cannot_hold(roles: dict, field: str, numbers: list[str]) -> None:
    scheduler = Scheduler(gpu_cluster(2), te_be_plus_policy())
    with pytest.raises(InvalidArgument) as raised:
        scheduler.submit(spec("huge", **roles), now=0)
    assert raised.value.field == field
    for number in numbers:
        assert number in raised.value.message
    assert scheduler.pending_count == 0


def test_replica_that_fits_no_single_node_names_its_resources() -> None:
    cluster = Cluster([NodeSpec("gpu", Resources(cpu_millis=8_000, memory_mib=1024, gpu=8)),
                       NodeSpec("cpu", Resources(cpu_millis=96_000, memory_mib=1024, gpu=0))])
    scheduler = Scheduler(cluster, fifo_policy())
    with pytest.raises(InvalidArgument) as raised:
        scheduler.submit(spec(chief=RoleSpec(1, Resources(cpu_millis=32_000, memory_mib=512, gpu=4))), now=0)
    assert raised.value.field == "roles.chief.resources"


def test_duplicate_job_id_is_rejected_while_the_job_lives() -> None:
    scheduler = Scheduler(gpu_cluster(1), fifo_policy())
    scheduler.submit(spec("a"), now=0)
    with pytest.raises(AlreadyExists, match="'a'"):
        scheduler.submit(spec("a"), now=1)
    scheduler.schedule(now=1)
    scheduler.finish("a", now=2)
    scheduler.submit(spec("a"), now=3)
