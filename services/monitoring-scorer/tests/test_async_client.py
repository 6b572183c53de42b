"""The contract's asyncio client against a real monitoring-scorer: a version's status and windows read
page by page as the blocking client reads them, with the same errors, the token on every call, and
each call bounded by its ``timeout``."""

from __future__ import annotations

import socket
from contextlib import aclosing

import pytest

from opml_common.errors import DeadlineExceeded, NotFound, Unauthenticated
from opml_devstack.testing.services import TOKENS
from opml_monitoring_scorer_contract.aioclient import AsyncMonitoringClient

from .conftest import BATCH, WINDOW, Producer, wait_labelled, wait_windows, writer

pytestmark = pytest.mark.timeout(480)


async def test_status_and_windows_read_as_the_blocking_client_reads_them(stack, world, platform_settings) -> None:
    scorer = stack.scorer().start()
    with writer(scorer) as blocking:
        blocking.register("fraud", "1", stack.context, "reference")
        async with Producer(platform_settings) as producer:
            await producer.send(world.rows(WINDOW * 3 + BATCH))  # three windows closed, one open
            await producer.send_labels([f"req-{i}" for i in range(WINDOW // BATCH)])  # window 0's
            wait_windows(blocking, "fraud", "1", 3, process=scorer)
            wait_labelled(blocking, "fraud", "1", [0])
        expected = list(blocking.windows("fraud", "1", page_size=1000))
        status = blocking.status("fraud", "1")
    async with AsyncMonitoringClient(scorer.target, token=TOKENS["reader"]) as client:
        assert await client.status("fraud", "1", timeout=30) == status
        read = [w async for w in client.windows("fraud", "1", page_size=1, timeout=30)]  # a page a window
        assert [w.index for w in read] == [2, 1, 0] and read == expected
        async with aclosing(client.windows("fraud", "1", page_size=1)) as newest_first:
            assert (await anext(newest_first)).index == 2  # a reader that stops early
        with pytest.raises(NotFound):
            await client.status("fraud", "9")
        with pytest.raises(NotFound):
            [w async for w in client.windows("fraud", "9")]
    async with AsyncMonitoringClient(scorer.target) as anonymous:
        with pytest.raises(Unauthenticated):
            await anonymous.status("fraud", "1")


async def test_a_scorer_that_does_not_answer_fails_each_call_at_its_timeout() -> None:
    """As any client's call past its deadline: DeadlineExceeded (retriable), not taken for an outage."""
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts connections, never speaks
        async with AsyncMonitoringClient(f"127.0.0.1:{silent.getsockname()[1]}") as client:
            with pytest.raises(DeadlineExceeded, match="Deadline Exceeded") as late:
                await client.status("fraud", "1", timeout=0.2)
            assert late.value.retriable
            with pytest.raises(DeadlineExceeded, match="Deadline Exceeded"):
                [w async for w in client.windows("fraud", "1", timeout=0.2)]
