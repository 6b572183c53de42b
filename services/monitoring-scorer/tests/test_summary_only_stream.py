"""Predictions that carry only summaries (the router's record cap below their tensors) scored by a real
scorer on the real broker, bundle-store and Redis: windows of them get a score from the drift of their
summary statistics and their data quality (no MPP/CBPE estimate, and the window says why), and a
shift of the inputs raises an alert on a rule that names a summary statistic."""

from __future__ import annotations

import numpy as np
import pytest

from .conftest import BATCH, WINDOW, Producer, wait_windows, writer

pytestmark = pytest.mark.timeout(480)
STATS = ("mean", "std", "min", "max")
RULES = "rules: [{name: summary-drift, signal: drift, over: 0.5, features: ['summary:x.mean'], for: 2}]\n"


async def test_summary_only_predictions_are_scored_on_their_summaries(stack, world, platform_settings) -> None:
    scorer = stack.scorer().start()
    with writer(scorer) as client:
        client.register("fraud", "1", stack.context, "reference")
        client.set_rules("fraud", "1", RULES)
        # record cap 0: each request of BATCH rows is logged as summaries only, and counts one toward
        # the window of WINDOW predictions
        async with Producer(platform_settings, record_cap_bytes=0) as producer:
            await producer.send(world.rows(WINDOW * BATCH * 2))
            clean = wait_windows(client, "fraud", "1", 2, process=scorer)
            assert client.alerts("fraud", "1") == []
            await producer.send(world.rows(WINDOW * BATCH * 2, shift=np.array([2.0, 0, 0, 0])))
            windows = wait_windows(client, "fraud", "1", 4, process=scorer)
        assert [w.index for w in windows] == [0, 1, 2, 3] and all(w.rows == 0 for w in windows)
        for w in windows:
            assert not w.HasField("mpp") and not w.HasField("cbpe")
            assert "summary_only" in w.flags and "no_estimate:summary_only" in w.flags, w.flags
            assert sorted(w.parts) == ["data_quality", "drift"]
            assert w.score == pytest.approx(w.parts["drift"] * w.parts["data_quality"])
            assert sorted(d.feature for d in w.drift) == sorted(f"summary:x.{s}" for s in STATS)
        for w in clean:
            mean = next(d for d in w.drift if d.feature == "summary:x.mean")
            assert mean.distance < 0.5 and w.score > 0.5
        for w in windows[2:]:
            mean = next(d for d in w.drift if d.feature == "summary:x.mean")
            assert mean.drifted and mean.distance > 1.0
        (alert,) = client.alerts("fraud", "1")
        assert (alert.rule, alert.raised_at_window, alert.firing) == ("summary-drift", 3, True)
        assert list(alert.features) == ["summary:x.mean"]
        status = client.status("fraud", "1")
        assert status.firing == ["summary-drift"] and status.last_window.index == 3
