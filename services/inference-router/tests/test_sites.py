"""Sites in placement: the transfer and round-trip rules, the planner keeping models off refused
workers, nearest sites first, and re-placement off a lost host's workers."""

from __future__ import annotations

import pytest

from opml_common.errors import InvalidArgument
from opml_inference_router.placement import (
    CostAwareSloPolicy,
    Fleet,
    FleetConfig,
    Link,
    Planner,
    PoolConfig,
    Replanner,
    SiteRule,
    site_distance,
)
from opml_inference_router.testing.placement import CPU, book, config, demand

EDGE = Link(rtt_ms=50.0, bandwidth_mbps=10.0)
CLOUD = Link(rtt_ms=2.0, bandwidth_mbps=1000.0)


def three_sites() -> Fleet:
    pools = (PoolConfig(name="cloud", kind="cpu", workers=1, site="cloud"),
             PoolConfig(name="edge-a", kind="cpu", workers=1, site="edge-a"),
             PoolConfig(name="edge-b", kind="cpu", workers=1, site="edge-b"))
    return Fleet(FleetConfig(pool_kinds=(CPU,), pools=pools, min_replicas=2))


def test_pools_are_local_unless_they_name_a_site() -> None:
    fleet = Fleet(FleetConfig(pool_kinds=(CPU,), pools=(PoolConfig(name="a", kind="cpu", workers=1),
                                                       PoolConfig(name="b", kind="cpu", workers=1, site="edge"))))
    assert [(worker.id, worker.site) for worker in fleet.workers] == [("a-000", "local"), ("b-000", "edge")]


def test_a_model_whose_bytes_arrive_too_late_for_its_slo_is_refused_the_site() -> None:
    rule = SiteRule(transfer_slo_factor=400)
    model = config("m", rate=10, slo=200.0)  # 80 s
    assert EDGE.transfer_s(10_000_000) == pytest.approx(0.05 + 8.0)
    assert rule.refusal(model, 10_000_000, "edge", EDGE) == ""
    refusal = rule.refusal(model, 120_000_000, "edge", EDGE)  # 96 s at 10 Mbit/s
    assert "take 96.0 s to arrive" in refusal and "budget of 80.0 s" in refusal
    assert rule.refusal(model, 120_000_000, "cloud", CLOUD) == ""
    assert rule.refusal(model, 10**12, "local", None) == ""  # the router's own disk


def test_a_site_farther_than_half_the_slo_is_refused_and_an_unmeasured_one_too() -> None:
    rule = SiteRule()
    assert "round trip of 50.0 ms" in rule.refusal(config("m", rate=10, slo=80.0), 1000, "edge", EDGE)
    assert rule.refusal(config("m", rate=10, slo=100.0), 1000, "edge", EDGE) == ""
    assert "not measured" in rule.refusal(config("m", rate=10, slo=100.0), 1000, "edge", None)
    with pytest.raises(InvalidArgument, match="route_slo_fraction"):
        SiteRule(route_slo_fraction=0)


def test_replicas_go_to_the_nearest_sites_the_rule_allows() -> None:
    fleet = three_sites()
    links = {"cloud": CLOUD, "edge-a": EDGE, "edge-b": Link(rtt_ms=20.0, bandwidth_mbps=10.0)}
    rule = SiteRule()
    planner = Planner(fleet=fleet, policy=CostAwareSloPolicy(site_rtt_ms=site_distance(links)),
                      usable=lambda want, worker: rule.refusal(want.config, 1_000_000, worker.site, links.get(worker.site)))
    plan = planner.plan([demand("near", rate=10, slo=200.0)], book("near"))
    assert sorted(plan.placements[demand("near", rate=10).model].workers) == ["cloud-000", "edge-b-000"]
    # a tight SLO keeps the model off both edges (their round trips): one replica, in the cloud
    plan = planner.plan([demand("tight", rate=10, slo=30.0)], book("tight"))
    assert plan.placements[demand("tight", rate=10).model].workers == ("cloud-000",)


def test_a_model_no_worker_may_host_is_unplaced_with_each_reason() -> None:
    fleet = three_sites()
    planner = Planner(fleet=fleet, policy=CostAwareSloPolicy(), usable=lambda model, worker: f"{worker.site} is cut")
    plan = planner.plan([demand("m", rate=10)], book("m"))
    reason = plan.unplaced[demand("m", rate=10).model]
    assert "cloud-000: cloud is cut" in reason and "edge-b-000: edge-b is cut" in reason


def test_a_model_on_a_lost_hosts_worker_is_re_placed_and_the_others_stay() -> None:
    fleet = three_sites()
    lost: set[str] = set()
    planner = Planner(fleet=fleet, policy=CostAwareSloPolicy(),
                      usable=lambda model, worker: "host lost" if worker.id in lost else "")
    demands = [demand("m", rate=10, slo=200.0)]
    plan = planner.plan(demands, book("m"))
    before = plan.placements[demands[0].model].workers
    lost.add(before[0])
    replan = Replanner(planner=planner).replan(plan, demands, book("m"), {})
    after = replan.plan.placements[demands[0].model].workers
    assert before[0] not in after and before[1] in after and len(after) == 2
    assert replan.reasons[demands[0].model] == f"{before[0]}: host lost"
