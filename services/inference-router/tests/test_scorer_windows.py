"""A version's windows read back from the monitoring-scorer (:class:`ScorerWindows`, what confirms a
rollout's failed quality check) through the scorer's contract client on the test's event loop, as on the
router's: the domain errors the rollout takes for "not confirmed", the router's token, the call timeout."""

from __future__ import annotations

import socket

import pytest

from opml_common.errors import DeadlineExceeded, NotFound, Unauthenticated
from opml_devstack.process import ServiceProcess
from opml_devstack.testing.services import TOKENS, ServiceStarter
from opml_inference_router.control.scorer_windows import ScorerWindows


@pytest.fixture
def monitoring_scorer(start_service: ServiceStarter) -> ServiceProcess:
    store = start_service("bundle-store")
    return start_service("monitoring-scorer", extra_env={"OPML_MONITORING_SCORER_BUNDLE_STORE_TARGET": store.target})


async def test_a_version_the_scorer_does_not_monitor_is_not_found_and_the_token_is_sent(
        monitoring_scorer: ServiceProcess) -> None:
    windows, anonymous = (ScorerWindows(monitoring_scorer.target, token=TOKENS["reader"]),
                          ScorerWindows(monitoring_scorer.target))
    try:
        with pytest.raises(NotFound):
            await windows.since("unmonitored", 1, 0.0)
        with pytest.raises(Unauthenticated):
            await anonymous.since("unmonitored", 1, 0.0)
    finally:
        await windows.close()
        await anonymous.close()


async def test_a_scorer_that_does_not_answer_fails_the_read_at_the_timeout() -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts connections, never speaks
        windows = ScorerWindows(f"127.0.0.1:{silent.getsockname()[1]}", timeout_s=0.2)
        try:
            with pytest.raises(DeadlineExceeded, match="Deadline Exceeded"):
                await windows.since("m", 1, 0.0)
        finally:
            await windows.close()
