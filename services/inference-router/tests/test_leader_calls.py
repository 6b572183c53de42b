"""LeaderCalls without processes: the leader serves a call itself; a follower with no leader to send
it to answers UNAVAILABLE saying so (also when the lease still names this replica's own address, as
after its restart), and leaves the RPCs it does not forward alone. Forwarding to a leader process:
tests/test_router_replicas.py."""

from __future__ import annotations

import pytest

from opml_common.errors import Unavailable
from opml_inference_router.leader_calls import LeaderCalls


class Servicer:
    async def Deploy(self, request, context):
        return f"deployed {request}"

    async def GetPlacement(self, request, context):
        return f"placement {request}"


class Context:
    def invocation_metadata(self):
        return (("authorization", "Bearer t"),)

    def time_remaining(self):
        return 5.0


def calls(*, leading: bool, leader: str | None) -> LeaderCalls:
    async def find() -> str | None:
        return leader

    return LeaderCalls(Servicer(), stub=lambda channel: None, methods=frozenset({"Deploy"}),
                       leading=lambda: leading, leader=find, me="10.0.0.1:50053")


async def test_the_leader_serves_its_calls_itself() -> None:
    assert await calls(leading=True, leader="10.0.0.1:50053").Deploy("r", Context()) == "deployed r"


@pytest.mark.parametrize("leader", [None, "10.0.0.1:50053"], ids=["lease free", "lease names this replica"])
async def test_a_follower_with_no_leader_to_forward_to_answers_unavailable(leader: str | None) -> None:
    with pytest.raises(Unavailable) as refused:
        await calls(leading=False, leader=leader).Deploy("r", Context())
    assert "Deploy: no inference-router replica leads now" in refused.value.message


async def test_a_follower_serves_what_it_does_not_forward() -> None:
    assert await calls(leading=False, leader=None).GetPlacement("r", Context()) == "placement r"
