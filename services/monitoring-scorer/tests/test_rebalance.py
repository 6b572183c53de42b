"""Two scorer processes in one consumer group on the real broker, bundle-store and Redis: predictions of
one version per partition of the predictions topic flow while a second scorer joins (a rebalance with
windows open) and the first is SIGKILLed with windows open; every window of every version is scored
exactly once across the two, and the survivor takes over the killed one's partitions.

Counted three ways: the score history (indexes 0..n-1, each window's rows), each process's
``windows_total`` per version (the killed one's at the kill plus the survivor's add up to the windows
sent, so no window was scored by both), and the ``windows`` table's changelog (one entry per closed
window: each (version, index) closed once). Before the kill the test waits until the changelog holds
every window closed so far, so no close is in flight when the first dies (a close whose table write
was lost is closed again by design, under the same index; that is not what this test is about)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from contextlib import AsyncExitStack

import pytest
from aiokafka.partitioner import DefaultPartitioner

from opml_common.config import PlatformSettings
from opml_devstack.process import ServiceProcess
from opml_devstack.testing.bus import poll_until, read_records
from opml_devstack.testing.metrics import samples, scrape
from opml_devstack.testing.services import env_prefix
from opml_inference_router_contract.predictions import prediction_subject
from opml_monitoring_scorer.__main__ import SPEC
from opml_monitoring_scorer.topics import PREDICTIONS

from .conftest import WINDOW, Producer, wait_windows, writer

pytestmark = pytest.mark.timeout(600)
ROUNDS = 20
"""Most windows per version sent after the join before the second scorer must have closed one."""


def versions_on_every_partition(model: str = "fraud") -> list[str]:
    """One version of ``model`` per partition of the predictions topic (the producer's partitioner on
    its key)."""
    partitions = list(range(PREDICTIONS.partitions))
    chosen: dict[int, str] = {}
    n = 0
    while len(chosen) < len(partitions):
        n += 1
        key = prediction_subject(model, str(n)).encode()  # the router's key of the version's records
        chosen.setdefault(DefaultPartitioner()(key, partitions, partitions), str(n))
    return [chosen[p] for p in partitions]


async def changelog(settings: PlatformSettings, count: int) -> Counter:
    """The ``windows`` table's changelog once it holds ``count`` entries (and no more arrived): how many
    times each (version, window index) was closed."""
    topic = f"{settings.topic_prefix}monitoring-scorer-windows-changelog"
    records = await read_records(settings, topic, count, timeout_s=120.0)
    return Counter((json.loads(r.key).split("/", 1)[1], json.loads(r.value)["index"] - 1) for r in records)


def closed(process: ServiceProcess, model: str = "fraud") -> dict[str, float]:
    """Windows the process closed, per version of ``model`` (its opml_monitoring_scorer_windows_total)."""
    page = samples(scrape(process.env[f"{env_prefix(SPEC)}METRICS_PORT"]))
    return {s.labels["version"]: s.value for s in page
            if s.name == "opml_monitoring_scorer_windows_total" and s.labels.get("model") == model}


def rejected(process: ServiceProcess) -> float:
    page = samples(scrape(process.env[f"{env_prefix(SPEC)}METRICS_PORT"]))
    return sum(s.value for s in page if s.name == "opml_monitoring_scorer_predictions_rejected_total")


async def test_two_scorers_score_every_window_once_through_a_join_and_a_sigkill(stack, world,
                                                                              platform_settings) -> None:
    versions = versions_on_every_partition()
    first = stack.scorer().start()
    with writer(first) as client:
        for version in versions:
            client.register("fraud", version, stack.context, "reference")
    second = stack.another_scorer()
    rows = dict.fromkeys(versions, 0)  # sent per version

    async with AsyncExitStack() as stack_of_producers:
        producers = {v: await stack_of_producers.enter_async_context(
            Producer(platform_settings, version=v, ids=f"v{v}")) for v in versions}

        async def send(count: int) -> None:
            """``count`` rows more of every version, published; then every version's windows closed."""
            await asyncio.gather(*(producers[v].send(world.rows(count)) for v in versions))
            for v in versions:
                rows[v] += count
                live = second if first.process.poll() is not None else first  # a failure shows its log
                with writer(live) as client:
                    await asyncio.to_thread(wait_windows, client, "fraud", v, rows[v] // WINDOW, process=live)

        await send(WINDOW + WINDOW // 2)  # the first alone; every version has a window open
        second.start()  # joins the group: a rebalance while windows are open
        for _ in range(ROUNDS):  # until the join has given the second partitions it closed windows on
            await send(WINDOW)
            if closed(second):
                break
        else:
            raise AssertionError(f"the second scorer closed no window in {ROUNDS} windows per version")
        assert closed(first), "the first scored too"
        first_before = closed(first)
        second_before = closed(second)

        await send(WINDOW * 3)  # both score; every version has half a window open again
        await changelog(platform_settings, sum(n // WINDOW for n in rows.values()))  # every close written
        at_kill = closed(first)
        killed_owned = {v for v, n in at_kill.items() if n > first_before.get(v, 0)}
        assert killed_owned, "the first owned partitions while both ran"
        first.kill()  # SIGKILL with windows open on its partitions (their events unacked)
        await send(WINDOW * 2 + WINDOW // 2)  # closes the open windows and two more on every version

    with writer(second) as client:
        for version in versions:
            total = rows[version] // WINDOW
            found = wait_windows(client, "fraud", version, total, process=second)
            assert [w.index for w in found] == list(range(total)), f"version {version}: no window lost, none twice"
            assert [w.rows for w in found] == [WINDOW] * total, f"version {version}: no prediction lost or twice"
            assert client.status("fraud", version).predictions == WINDOW * total
    totals = {v: n // WINDOW for v, n in rows.items()}
    survivor = poll_until(lambda: (page := closed(second)) and all(
        page.get(v, 0) + at_kill.get(v, 0) >= totals[v] for v in versions) and page, timeout_s=60.0,
        what="the survivor's windows_total")
    assert {v: survivor.get(v, 0) + at_kill.get(v, 0) for v in versions} == totals, \
        ("each window scored by one of the two", at_kill, survivor)
    closes = await changelog(platform_settings, sum(totals.values()))
    assert closes == Counter({(v, i): 1 for v in versions for i in range(totals[v])}), "each window closed once"
    assert all(survivor.get(v, 0) > second_before.get(v, 0) for v in killed_owned), \
        ("the survivor took over the killed one's partitions", killed_owned, second_before, survivor)


async def test_a_version_registered_and_its_rules_set_on_one_scorer_are_used_by_the_other(
        stack, world, platform_settings) -> None:
    """Registrations and rules are made through one process's API (or its deployments consumer, which
    one process of the group handles per event), while another process may own the version's partition."""
    first = stack.scorer().start()
    second = stack.another_scorer().start()
    versions = versions_on_every_partition()
    with writer(first) as client:
        for version in versions:
            client.register("fraud", version, stack.context, "reference")
    # the second restored those at its start: rounds of a window per version until both have scored
    async with AsyncExitStack() as producers_stack:
        producers = {v: await producers_stack.enter_async_context(
            Producer(platform_settings, version=v, ids=f"v{v}")) for v in versions}
        for round_ in range(1, ROUNDS + 1):
            await asyncio.gather(*(producers[v].send(world.rows(WINDOW)) for v in versions))
            with writer(first) as client:
                for v in versions:
                    await asyncio.to_thread(wait_windows, client, "fraud", v, round_, process=first)
            if closed(first) and closed(second):
                break
        else:
            raise AssertionError(f"the two scorers did not both score in {ROUNDS} windows per version")

    late = versions_on_every_partition("late")  # one on each partition: some the second owns
    with writer(first) as client:
        for version in late:
            client.register("late", version, stack.context, "reference")
    async with AsyncExitStack() as producers_stack:
        producers = {v: await producers_stack.enter_async_context(
            Producer(platform_settings, model="late", version=v, ids=f"late{v}")) for v in late}
        await asyncio.gather(*(producers[v].send(world.rows(WINDOW)) for v in late))
        with writer(first) as client:
            for version in late:
                await asyncio.to_thread(wait_windows, client, "late", version, 1, process=second)
                # once the version is scored (adopted where its partition is), a rule that fires at once
                client.set_rules("late", version, "rules: [{name: always, signal: score, under: 2.0, for: 1}]\n")
        await asyncio.gather(*(producers[v].send(world.rows(WINDOW)) for v in late))
    with writer(first) as client:
        for version in late:
            found = wait_windows(client, "late", version, 2, process=second)
            assert [w.index for w in found] == [0, 1] and all(w.rows == WINDOW for w in found)
            (alert,) = client.alerts("late", version)
            assert (alert.rule, alert.raised_at_window) == ("always", 1), "the rules set on the first"
    assert closed(second, "late"), "the second scored late versions on its partitions"
    with writer(second) as client:  # the API of either process shows every version, wherever it is scored
        for version in late:
            status = client.status("late", version)
            assert (status.windows, status.firing) == (2, ["always"])
            assert "always" in client.get_rules("late", version).yaml
    assert rejected(first) == rejected(second) == 0, "nothing dead-lettered as unknown"
