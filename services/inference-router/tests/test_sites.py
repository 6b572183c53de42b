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
    ModelDemand,
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


def one_slot_sites() -> Fleet:
    """Three sites of one single-slot worker each: a lost one's replica finds no free slot elsewhere."""
    kind = CPU.model_copy(update={"slots": 1})
    pools = tuple(PoolConfig(name=site, kind="cpu", workers=1, site=site) for site in ("cloud", "edge-a", "edge-b"))
    return Fleet(FleetConfig(pool_kinds=(kind,), pools=pools, min_replicas=2))


@pytest.mark.parametrize("rate", [10.0, 400.0], ids=["floor", "load"])  # its 2 replicas: N+1, or what its load needs
def test_a_lost_hosts_replica_with_no_free_slot_is_dropped_and_grows_back_when_it_returns(rate: float) -> None:
    fleet = one_slot_sites()
    lost: set[str] = set()
    planner = Planner(fleet=fleet, policy=CostAwareSloPolicy(),
                      usable=lambda model, worker: "host lost" if worker.id in lost else "")
    pair, single = demand("pair", rate=rate, slo=200.0), demand("single", rate=10, slo=200.0)
    single = ModelDemand(single.config.model_copy(update={"min_replicas": 1}), 1, 10)
    demands, profiles = [pair, single], book("pair", "single")
    plan = planner.plan(demands, profiles)
    before = plan.placements[pair.model].workers
    assert len(before) == 2 and len(plan.placements[single.model].workers) == 1
    lost.add(before[0])
    replan = Replanner(planner=planner).replan(plan, demands, profiles, {})
    after = replan.plan.placements[pair.model]
    # the third slot is the other model's: the lost replica is not named on its dead worker any more
    assert after.workers == (before[1],), after
    assert after.short == f"1 of 2 replicas ({before[0]}: host lost); the usable workers have no room for the rest"
    assert after.lost == (before[0],)
    assert replan.reasons[pair.model].startswith(f"{before[0]}: host lost")
    assert [type(move).__name__ for move in replan.moves] == ["RemoveReplica"]
    # a plain re-plan leaves it as it is; once the worker is back, a regrow puts the replica there again
    steady = Replanner(planner=planner).replan(replan.plan, demands, profiles, {})
    assert steady.plan.placements[pair.model] == after and not steady.moves
    lost.clear()
    back = Replanner(planner=planner).replan(replan.plan, demands, profiles, {}, regrow=True)
    assert back.plan.placements[pair.model].workers == (before[1], before[0])  # the one it kept stays put
    assert (back.plan.placements[pair.model].short, back.plan.placements[pair.model].lost) == ("", ())
    assert [type(move).__name__ for move in back.moves] == ["AddReplica", "WaitReady"]
    assert back.reasons[pair.model] == f"1 replicas grown to 2 on {before[0]}"


def test_a_regrow_brings_a_version_below_its_floor_up_to_it_where_workers_joined() -> None:
    fleet = three_sites()
    joined: set[str] = {"cloud-000"}
    planner = Planner(fleet=fleet, policy=CostAwareSloPolicy(),
                      usable=lambda model, worker: "" if worker.id in joined else "no host serves it")
    demands, profiles = [demand("m", rate=10, slo=200.0)], book("m")
    plan = planner.plan(demands, profiles)  # the floor is 2, one worker may be used
    assert plan.placements[demands[0].model].workers == ("cloud-000",)
    joined.add("edge-a-000")
    assert not Replanner(planner=planner).replan(plan, demands, profiles, {}).moves  # only a regrow grows it
    grown = Replanner(planner=planner).replan(plan, demands, profiles, {}, regrow=True)
    assert grown.plan.placements[demands[0].model].workers == ("cloud-000", "edge-a-000")


def test_a_model_whose_every_replica_was_on_lost_workers_and_finds_no_room_is_unplaced() -> None:
    fleet = one_slot_sites()
    lost: set[str] = set()
    planner = Planner(fleet=fleet, policy=CostAwareSloPolicy(),
                      usable=lambda model, worker: "host lost" if worker.id in lost else "")
    pair = demand("pair", rate=10, slo=200.0)
    single = demand("single", rate=10, slo=200.0)
    single = ModelDemand(single.config.model_copy(update={"min_replicas": 1}), 1, 10)
    demands, profiles = [pair, single], book("pair", "single")
    plan = planner.plan(demands, profiles)
    lost.add(plan.placements[single.model].workers[0])
    lost.add(plan.placements[pair.model].workers[0])  # the pair keeps one replica; the single one has no room
    replan = Replanner(planner=planner).replan(plan, demands, profiles, {})
    assert single.model not in replan.plan.placements and single.model in replan.plan.unplaced
    assert "unplaced" in replan.reasons[single.model]
    assert not lost & {w for _, w in replan.plan.replicas()}
