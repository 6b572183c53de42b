"""``ClientSession.follow``: a watcher that cannot reach its service says it reconnects, and gives up
with a clear message after its bound (``--reconnect-s``). Reconnecting to a restarted service and
resuming without repeats is tested against a real service by each watcher (job-orchestrator's
test_cli_reconnect.py)."""

from __future__ import annotations

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from opml_common.cligroup import ClientSession
from opml_common.errors import Unavailable
from opml_common.grpc.client import ServiceClient
from opml_common.ports import hold_free_port


class HealthClient(ServiceClient):
    stub_class = health_pb2_grpc.HealthStub


def test_a_watcher_gives_up_after_its_bound_naming_it(capsys) -> None:
    with hold_free_port() as held:  # bound, not listening: every connection is refused
        target = f"127.0.0.1:{held.getsockname()[1]}"
        session = ClientSession(HealthClient, target, None, {}, reconnect_s=0.5)
        with pytest.raises(Unavailable) as caught:
            list(session.follow(lambda client: client.stub.Watch(health_pb2.HealthCheckRequest())))
    assert caught.value.message.startswith(f"{target} stayed unreachable for 0.5 s, gave up (--reconnect-s): ")
    assert f"reconnecting to {target} in 0.2 s" in capsys.readouterr().err
