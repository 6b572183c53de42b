"""What the control plane shows of itself: the one domain type that the manager provides and that
:mod:`.convert` reads to build API replies and event data (so convert never imports the manager)."""

from __future__ import annotations

from typing import Protocol

from opml_inference_router.control.pools import PoolManager
from opml_inference_router.placement import Fleet, Plan, ProfileBook


class DeploymentView(Protocol):
    """The current plan, profiles, pools and traffic split (read-only use)."""

    @property
    def plan(self) -> Plan: ...

    @property
    def profiles(self) -> ProfileBook: ...

    @property
    def fleet(self) -> Fleet: ...

    @property
    def pools(self) -> PoolManager: ...

    def traffic_percent(self, name: str) -> dict[str, float]:
        """Version -> share of ``name``'s traffic in percent (versions with none left out)."""
        ...
