"""The monitoring-scorer as a real process on the real broker, S3 (bundle-store) and Redis.

Predictions are PredictionMade events built by the inference-router's contract (``prediction_made`` on
KServe v2 messages encoded by the shared codec) and published to the real broker, as the router does;
the serving path itself (router and workers) is not started here.
"""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from opml.monitoring.v1 import alert_events_pb2

from opml_common.bus.cloudevents import CloudEvent
from opml_common.errors import InvalidArgument, NotFound
from opml_devstack.testing.bus import read_records
from opml_devstack.testing.services import TOKENS
from opml_monitoring_scorer.cli import monitor
from opml_monitoring_scorer.core.reference import performance
from opml_monitoring_scorer.topics import LABELS
from opml_monitoring_scorer_contract.topics import ALERTS

from .conftest import BATCH, WINDOW, Producer, wait_labelled, wait_windows, writer

pytestmark = pytest.mark.timeout(480)


async def test_clean_stream_no_alert_then_covariate_shift_alerts_and_late_labels_give_the_truth(
        stack, world, platform_settings, tmp_path) -> None:
    scorer = stack.scorer().start()
    with writer(scorer) as client:
        status = client.register("fraud", "1", stack.context, "reference")
        assert (status.task, status.reference_rows, list(status.limitations)) == ("binary", 3000, [])
        async with Producer(platform_settings) as producer:
            clean = world.rows(WINDOW * 6)
            await producer.send(clean)
            windows = wait_windows(client, "fraud", "1", 6, process=scorer)
            assert [w.index for w in windows] == list(range(6)) and all(w.rows == WINDOW for w in windows)
            assert client.alerts("fraud", "1") == [], "a clean stream raises no alert"
            truth = performance(world.task, clean.outputs.predicted, clean.labels)
            assert abs(np.mean([w.mpp for w in windows]) - truth) < 0.05
            assert abs(np.mean([w.cbpe for w in windows]) - truth) < 0.05

            shifted = world.rows(WINDOW * 4, shift=np.array([2.0, 0, 0, 0]))
            await producer.send(shifted)
            windows = wait_windows(client, "fraud", "1", 10, process=scorer)
            (alert,) = client.alerts("fraud", "1")
            assert alert.rule == "drift" and alert.firing and alert.raised_at_window == 7  # `for: 2` windows
            assert "x0" in alert.features and "x1" not in alert.features
            assert client.status("fraud", "1").firing == ["drift"]
            records = await read_records(platform_settings, ALERTS.full_name(platform_settings.topic_prefix), 1)
            raised = CloudEvent.from_kafka(records[0].headers, records[0].value).parse(alert_events_pb2.AlertRaised)
            assert (raised.model, raised.rule, raised.evidence.window) == ("fraud", "drift", 7)
            assert raised.evidence.features["x0"] > 0.25

            await producer.send_labels([f"req-{i}" for i in range(WINDOW * 2 // BATCH)])  # windows 0 and 1
            deadline_windows = wait_windows(client, "fraud", "1", 10)
            labelled = wait_labelled(client, "fraud", "1", [0, 1])
            assert len(deadline_windows) == 10
            for w in labelled:
                rows = slice(w.index * WINDOW, (w.index + 1) * WINDOW)
                assert w.true_value == pytest.approx(performance(world.task, clean.outputs.predicted[rows],
                                                                 clean.labels[rows]))

    # the CLI on the same history: tables, rules round trip, and the PNG of estimated against true quality
    cli = CliRunner()
    base = ["--target", scorer.target, "--token", TOKENS["writer"]]
    shown = cli.invoke(monitor, [*base, "windows", "fraud", "1", "--limit", "3"])
    assert shown.exit_code == 0 and "x0" in shown.output, shown.output  # the shifted windows name x0
    listed = cli.invoke(monitor, [*base, "alerts", "fraud", "1"])
    assert listed.exit_code == 0 and "drift" in listed.output and "firing" in listed.output
    png = tmp_path / "quality.png"
    plotted = cli.invoke(monitor, [*base, "plot", "fraud", "1", "-o", str(png)])
    assert plotted.exit_code == 0, plotted.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules: [{name: bad-data, signal: data_quality, over: 0.2}]\n")
    assert cli.invoke(monitor, [*base, "rules", "set", "fraud", "1", "-f", str(rules)]).exit_code == 0
    got = cli.invoke(monitor, [*base, "rules", "get", "fraud", "1"])
    assert "bad-data" in got.output and "drift" not in got.output


async def test_bad_requests_are_refused_and_malformed_labels_dead_lettered(stack, world, platform_settings) -> None:
    scorer = stack.scorer().start()
    with writer(scorer) as client:
        with pytest.raises(NotFound):
            client.status("nobody", "1")
        with pytest.raises(InvalidArgument) as caught:
            client.register("", "1", "", "reference")
        assert [f for f, _ in caught.value.violations] == ["model", "reference.context"]
        with pytest.raises(NotFound):
            client.register("fraud", "1", stack.context, "no-such-bundle")
        client.register("fraud", "1", stack.context, "reference")
        with pytest.raises(InvalidArgument) as caught:
            client.set_rules("fraud", "1", "- {name: x, signal: nope, under: 1}\n- {name: y, signal: score}\n")
        assert [f for f, _ in caught.value.violations] == ["rules[0].signal", "rules[1]"]
        async with Producer(platform_settings) as producer:
            await producer.send(world.rows(WINDOW))
            wait_windows(client, "fraud", "1", 1, process=scorer)
            producer.labels["req-0"] = [1.0, 2.0]  # two values for a batch of ten rows
            await producer.send_labels(["req-0"])
        prefix = platform_settings.topic_prefix
        (bad_label,) = await read_records(platform_settings, LABELS.dead_letter(prefix), 1)
        assert b"holds 2 values, but request req-0 predicted 10 rows" in dict(bad_label.headers)["opml_error"]
