"""Sites: where workers are, and whether a model may be placed there given the link to the router.

A pool's workers are at a site (``PoolConfig.site``): ``local`` is the router's machine; any other
site is reached over a link whose round trip and bandwidth the router measures
(:mod:`opml_inference_router.hosts`). Two rules keep a model off a site whose link cannot carry it:

- **transfer**: the model's bundle must arrive within its budget,
  ``rtt + bytes x 8 / bandwidth <= transfer_slo_factor x slo.p99_ms``. The budget grows with the
  SLO because a tight SLO marks a model that cannot wait long for capacity: when a site is lost,
  its replacement replicas must come up quickly, so a site its bytes take long to reach is no
  place for it;
- **round trip**: a request the router forwards pays the link's round trip before the worker
  starts, so ``rtt <= route_slo_fraction x slo.p99_ms`` (half of it by default: the other half is
  the replica's own p99 budget).

Placement prefers the nearest sites (:class:`~.policy.CostAwareSloPolicy` ranks workers by their
site's round trip), so a model's replicas, and the requests the router sends them, go to the
nearest sites that can serve it. Pure: the router's host registry feeds it the measured links.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from opml_common.errors import InvalidArgument
from opml_inference_router.placement.fleet import Worker
from opml_inference_router.placement.fleet_config import LOCAL_SITE
from opml_inference_router.placement.plan import ModelDemand
from opml_inference_router_contract.model_config import ModelConfig


@dataclass(frozen=True)
class Link:
    """The router's link to a site, as measured: round trip and bandwidth (bytes travel at it)."""

    rtt_ms: float
    bandwidth_mbps: float

    def transfer_s(self, nbytes: int) -> float:
        """Seconds ``nbytes`` take to arrive: one round trip to ask, then the bytes at the bandwidth."""
        return self.rtt_ms / 1000 + nbytes * 8 / (self.bandwidth_mbps * 1e6)

    def __str__(self) -> str:
        return f"{self.rtt_ms:.1f} ms round trip, {self.bandwidth_mbps:.1f} Mbit/s"


LOCAL_LINK = Link(0.0, math.inf)


@dataclass(frozen=True)
class SiteRule:
    """The two rules of the module, with their factors (both > 0)."""

    transfer_slo_factor: float = 400.0
    route_slo_fraction: float = 0.5

    def __post_init__(self) -> None:
        for name in ("transfer_slo_factor", "route_slo_fraction"):
            if not getattr(self, name) > 0:
                raise InvalidArgument(name, f"must be > 0, but got {getattr(self, name)}")

    def transfer_budget_s(self, config: ModelConfig) -> float:
        return self.transfer_slo_factor * config.slo.p99_ms / 1000

    def refusal(self, config: ModelConfig, bundle_bytes: int, site: str, link: Link | None) -> str:
        """Why the model may not be placed at ``site`` over ``link`` ('' when it may). ``None``: no
        link measured yet (the site's host has not been probed), so nothing is placed there."""
        if site == LOCAL_SITE:
            return ""
        if link is None:
            return f"site {site}: its link is not measured yet"
        arrive_s, budget_s = link.transfer_s(bundle_bytes), self.transfer_budget_s(config)
        if arrive_s > budget_s:
            return (f"site {site}: the model's {bundle_bytes} bytes take {arrive_s:.1f} s to arrive over its link "
                    f"({link}), more than its budget of {budget_s:.1f} s ({self.transfer_slo_factor:g} x its "
                    f"p99 SLO of {config.slo.p99_ms:g} ms)")
        if link.rtt_ms > self.route_slo_fraction * config.slo.p99_ms:
            return (f"site {site}: its round trip of {link.rtt_ms:.1f} ms is more than {self.route_slo_fraction:g} "
                    f"x the model's p99 SLO of {config.slo.p99_ms:g} ms")
        return ""


def site_distance(links: Mapping[str, Link]) -> Callable[[str], float]:
    """The round trip to a site in ms, for ranking workers nearest first (0 for the router's own
    site; infinity for a site without a measured link)."""
    def rtt_ms(site: str) -> float:
        if site == LOCAL_SITE:
            return 0.0
        link = links.get(site)
        return link.rtt_ms if link is not None else math.inf
    return rtt_ms


WorkerCheck = Callable[[ModelDemand, Worker], str]
"""Why a worker may not host a model ('' when it may): what :class:`~.planner.Planner` takes as ``usable``."""
