"""Nearest-site choice of replicas: the choice itself (pure, fake replicas at named sites), the site a
request names (a KServe v2 string parameter read from its wire bytes) and the router's use of both:
retries and backup requests to the next nearest, spilling past a saturated site. (On real hosts
behind an emulated link: tests/test_hosts_netns.py.)"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest
from tritonclient.grpc import service_pb2 as pb

from opml_devstack.testing.bus import fresh_metrics, sample
from opml_inference_router.routing import ModelPolicy, Replica, ReplicaFailed, ReplicaSet, Router, wire
from opml_inference_router.routing.replicas import MAX_SITE_NAME, Sites

REQUEST = wire.encode_field(wire.MODEL_NAME, "m")


class AtSite(Replica):
    """A replica at ``site`` that answers after ``delay_s``, or fails while ``failing``."""

    def __init__(self, name: str, site: str, delay_s: float = 0.0) -> None:
        self.name, self.site, self.delay_s = name, site, delay_s
        self.failing = False
        self.calls = 0

    async def call(self, method: str, request: bytes, *, timeout_s: float) -> bytes:
        self.calls += 1
        if self.failing:
            raise ReplicaFailed("UNAVAILABLE", "site cut", retriable=True, eject=True, replica=self.name)
        await asyncio.sleep(min(self.delay_s, timeout_s))
        return wire.encode_field(wire.MODEL_NAME, "m") + self.name.encode()

    async def close(self) -> None:
        pass


RTT = {"cloud": 2.0, "edge-a": 50.0, "edge-b": 80.0}


def replica_set(placed: dict[str, str], *, saturation: int | None = None, policy: str = "p2c",
                clock: list[float] | None = None) -> ReplicaSet:
    sites = Sites()
    sites.measured(RTT)
    now = clock or [0.0]
    replicas = ReplicaSet(policy=policy, clock=lambda: now[0], rng=random.Random(5), sites=sites)
    for name, site in placed.items():
        replicas.add(AtSite(name, site))
    replicas.saturation = saturation
    return replicas


def by_name(replicas: ReplicaSet) -> dict:
    return {state.name: state for state in replicas}


def test_the_nearest_site_takes_every_request_and_load_is_balanced_within_it() -> None:
    replicas = replica_set({"e1": "edge-a", "c1": "cloud", "c2": "cloud", "c3": "cloud", "b1": "edge-b"},
                           saturation=4)
    states = by_name(replicas)
    states["c1"].outstanding, states["c2"].outstanding = 3, 1
    picks = Counter(replicas.pick().name for _ in range(400))
    assert set(picks) == {"c2", "c3"} and picks["c3"] > picks["c2"], picks  # p2c within the site
    # the router's own site is nearer than any measured one
    replicas.add(AtSite("l1", "local"))
    assert {replicas.pick().name for _ in range(50)} == {"l1"}


def test_a_site_spills_to_the_next_nearest_only_when_each_of_its_replicas_is_saturated() -> None:
    replicas = replica_set({"c1": "cloud", "c2": "cloud", "e1": "edge-a", "b1": "edge-b"}, saturation=4)
    states = by_name(replicas)
    states["c1"].outstanding = 4
    assert {replicas.pick().name for _ in range(50)} == {"c2"}  # one replica with room keeps the site
    states["c2"].outstanding = 4
    assert {replicas.pick().name for _ in range(50)} == {"e1"}
    states["e1"].outstanding = 4
    assert {replicas.pick().name for _ in range(50)} == {"b1"}
    states["b1"].outstanding = 4  # every site saturated: the nearest takes it (admission bounds the rest)
    assert {replicas.pick().name for _ in range(50)} <= {"c1", "c2"}
    states["c1"].outstanding = 3
    assert replicas.pick().name == "c1"


def test_unhealthy_replicas_send_retries_and_backups_to_the_next_nearest() -> None:
    clock = [0.0]
    replicas = replica_set({"c1": "cloud", "e1": "edge-a", "b1": "edge-b"}, clock=clock)
    states = by_name(replicas)
    assert replicas.pick().name == "c1"
    assert replicas.pick(exclude=[states["c1"]]).name == "e1"  # a retry or backup after trying c1
    assert replicas.pick(exclude=[states["c1"], states["e1"]]).name == "b1"
    replicas.failed(states["c1"], eject=True, error="cut")
    assert replicas.pick().name == "e1"  # ejected: skipped while it lasts
    replicas.mark_down("e1", "host lost", None)
    assert replicas.pick().name == "b1"
    clock[0] = 100.0  # the ejection over: the nearest again
    assert replicas.pick().name == "c1"


def test_a_site_not_measured_is_farthest_and_a_new_measure_reorders() -> None:
    replicas = replica_set({"x1": "unmeasured", "b1": "edge-b"})
    assert replicas.pick().name == "b1"
    replicas.sites.measured({"unmeasured": 10.0, "edge-b": 80.0})
    assert replicas.pick().name == "x1"


def test_the_clients_site_comes_first_and_an_unknown_one_changes_nothing() -> None:
    replicas = replica_set({"l1": "local", "c1": "cloud", "e1": "edge-a"}, saturation=2)
    assert replicas.pick(site="edge-a").name == "e1"
    assert replicas.pick(site="nowhere").name == "l1"
    assert replicas.pick(site="").name == "l1"
    states = by_name(replicas)
    states["e1"].outstanding = 2  # the client's site saturated: the nearest to the router after it
    assert replicas.pick(site="edge-a").name == "l1"
    assert replicas.pick(site="edge-a", exclude=[states["l1"]]).name == "c1"


def test_one_site_chooses_as_before_without_reading_sites() -> None:
    replicas = replica_set({"a": "cloud", "b": "cloud"}, saturation=1, policy="least")
    assert not replicas.multi_site
    states = by_name(replicas)
    states["a"].outstanding, states["b"].outstanding = 5, 3
    assert replicas.pick(site="edge-a").name == "b"  # saturated everywhere, one site: least outstanding
    replicas.add(AtSite("e", "edge-a"))
    assert replicas.multi_site
    replicas.remove("e")
    assert not replicas.multi_site


def _with_parameters(**parameters: object) -> bytes:
    request = pb.ModelInferRequest(model_name="m", id="r1")
    for key, value in parameters.items():
        if isinstance(value, bool):
            request.parameters[key].bool_param = value
        elif isinstance(value, int):
            request.parameters[key].int64_param = value
        else:
            request.parameters[key].string_param = value
    request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    request.raw_input_contents.append(b"\0" * 4096)
    return request.SerializeToString()


def test_the_site_parameter_is_read_from_the_wire_bytes_and_a_bad_one_is_ignored() -> None:
    site = wire.SITE_PARAMETER
    assert wire.string_parameter(_with_parameters(site="edge-a", other="x"), site, max_length=64) == "edge-a"
    assert wire.string_parameter(_with_parameters(other="edge-a"), site, max_length=64) == ""
    assert wire.string_parameter(_with_parameters(site=7), site, max_length=64) == ""  # not a string
    assert wire.string_parameter(_with_parameters(site="e" * 65), site, max_length=64) == ""  # too long
    assert wire.string_parameter(_with_parameters(), site, max_length=64) == ""
    # appended later (the last one wins, as for a parser)
    later = _with_parameters(site="edge-a") + pb.ModelInferRequest(parameters={
        site: pb.InferParameter(string_param="edge-b")}).SerializeToString()
    assert wire.string_parameter(later, site, max_length=64) == "edge-b"
    with pytest.raises(wire.MalformedMessage):
        wire.string_parameter(_with_parameters(site="edge-a")[:-3], site, max_length=64)
    with pytest.raises(wire.MalformedMessage):
        wire.string_parameter(REQUEST * 20, site, max_length=64, max_fields=10)


def make_router(placed: dict[str, AtSite], **policy: object) -> tuple[Router, object]:
    metrics, registry = fresh_metrics("inference-router")
    router = Router(connect=lambda address: placed[address], metrics=metrics, rng=random.Random(3))
    router.set_site_rtts(RTT)
    router.set_model("m", ModelPolicy(**policy))  # type: ignore[arg-type]
    for address in placed:
        router.add_replica("m", "1", address)
    return router, registry


async def test_the_router_answers_from_the_nearest_site_and_fails_over_to_the_next_one() -> None:
    near, far = AtSite("c1", "cloud"), AtSite("e1", "edge-a")
    router, registry = make_router({"c1": near, "e1": far}, hedge=False)
    for _ in range(10):
        assert (await router.infer("m", "", REQUEST, timeout_s=1.0)).site == "cloud"
    assert (far.calls, near.calls) == (0, 10)
    near.failing = True  # cut: the request is retried at the far site within its deadline, and c1 ejected
    routed = await router.infer("m", "", REQUEST, timeout_s=1.0)
    assert (routed.replica, routed.attempts) == ("e1", 2)
    assert (await router.infer("m", "", REQUEST, timeout_s=1.0)).attempts == 1  # c1 ejected: e1 first
    assert sample(registry, "opml_inference_router_site_answers_total", model="m", version="1", site="cloud") == 10
    assert sample(registry, "opml_inference_router_site_answers_total", model="m", version="1", site="edge-a") == 2


async def test_a_request_naming_its_site_is_served_there_and_a_backup_goes_to_the_next_nearest() -> None:
    local, cloud, edge = AtSite("l1", "local"), AtSite("c1", "cloud"), AtSite("e1", "edge-a", delay_s=0.5)
    router, _ = make_router({"l1": local, "c1": cloud, "e1": edge}, hedge_budget=1.0, hedge_min_delay_ms=1.0,
                            slo_p99_ms=40.0)
    at_edge = _with_parameters(site="edge-a")
    routed = await router.infer("m", "", at_edge, timeout_s=2.0)  # e1 slow: the backup to l1 (nearest) wins
    assert (routed.replica, routed.backup_won) == ("l1", True) and edge.calls == 1 and cloud.calls == 0
    edge.delay_s = 0.0
    routed = await router.infer("m", "", at_edge, timeout_s=2.0)
    assert routed.replica == "e1"
    routed = await router.infer("m", "", at_edge, timeout_s=2.0, site="x" * (MAX_SITE_NAME + 1))
    assert routed.replica == "l1"  # a site given over-long is ignored, not an error


async def test_requests_past_the_near_sites_share_of_the_admission_limit_spill_to_the_far_site() -> None:
    near, far = AtSite("c1", "cloud", delay_s=0.2), AtSite("e1", "edge-a", delay_s=0.2)
    router, registry = make_router({"c1": near, "e1": far}, max_concurrency=4, hedge=False)  # a share of 2 each
    routed = await asyncio.gather(*(router.infer("m", "", REQUEST, timeout_s=2.0) for _ in range(3)))
    assert Counter(r.replica for r in routed) == {"c1": 2, "e1": 1}
    await router.remove_replica("m", "1", "e1")
    router.add_replica("m", "1", "e1")
    near.delay_s = far.delay_s = 0.0
    assert (await router.infer("m", "", REQUEST, timeout_s=1.0)).replica == "c1"
