"""Versions the scorer was not told about, and labels sent through its API, on the real broker,
bundle-store and Redis with a real scorer.

A model deployed with ``opml model deploy --dir`` was never monitored and every prediction of it was
dead-lettered as UnknownModel (48,259 of one model in one run). Now a version the router deployed from
a directory is monitored with its first window as the baseline, and the valid predictions of a version
nobody registered are counted as skipped, never dead-lettered; malformed records still are.
Labels could be sent only by writing a Kafka producer: SubmitLabels (``opml monitor label``) publishes
them under the platform's label source."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from opml.inference.v1 import deployment_events_pb2, deployments_pb2
from opml.inference.v1 import events_pb2 as inference_events

from opml_common.errors import InvalidArgument, NotFound
from opml_devstack.process import ServiceProcess
from opml_devstack.testing.bus import poll_until, read_records
from opml_devstack.testing.metrics import samples, scrape
from opml_devstack.testing.services import TOKENS, env_prefix
from opml_inference_router_contract.predictions import prediction_subject
from opml_monitoring_scorer.__main__ import SPEC
from opml_monitoring_scorer.cli import monitor
from opml_monitoring_scorer.core.reference import performance
from opml_monitoring_scorer.topics import DEPLOYMENTS, PREDICTIONS

from .conftest import WINDOW, Producer, wait_labelled, wait_windows, writer

pytestmark = pytest.mark.timeout(480)
DEFAULT_WINDOW = 1000
"""The default config's window count (a version deployed from a directory has no monitoring.yaml)."""


def skipped(process: ServiceProcess) -> float:
    page = samples(scrape(process.env[f"{env_prefix(SPEC)}METRICS_PORT"]))
    return sum(s.value for s in page if s.name == "opml_monitoring_scorer_predictions_skipped_total"
               and s.labels.get("reason") == "unknown_model")


def deployed_from_directory(model: str, version: int) -> deployment_events_pb2.ModelDeployed:
    """The router's ModelDeployed of a ``--dir`` deploy: its version's source is a path, no bundle."""
    status = deployments_pb2.ModelVersionStatus(name=f"models/{model}/versions/{version}", version=version,
                                                model_dir="/srv/models/churn", traffic_percent=100.0)
    return deployment_events_pb2.ModelDeployed(
        deployment=deployments_pb2.Deployment(name=f"models/{model}", model=model, versions=[status],
                                              stable_version=version), version=version)


async def test_a_directory_deploy_is_monitored_and_an_unknown_version_is_skipped_not_dead_lettered(
        stack, world, platform_settings) -> None:
    scorer = stack.scorer().start()
    with writer(scorer) as client:
        async with Producer(platform_settings, model="churn") as router:
            await router.publisher.publish_proto(DEPLOYMENTS, deployed_from_directory("churn", 1), subject="churn")
            status = poll_until(lambda: _status_or_none(client, "churn", "1"), timeout_s=120.0,
                                what="churn version 1 monitored from its ModelDeployed")
            assert any("without a bundle" in note for note in status.limitations), status.limitations
            await router.queue(world.rows(DEFAULT_WINDOW * 2))
            windows = wait_windows(client, "churn", "1", 2, process=scorer)
            assert [w.rows for w in windows] == [DEFAULT_WINDOW, DEFAULT_WINDOW]
            baseline = client.status("churn", "1")  # the first window's rows are its reference now
            assert (baseline.task, baseline.reference_rows) == ("binary", DEFAULT_WINDOW)

        async with Producer(platform_settings, model="ghost", ids="ghost") as ghost:
            await ghost.queue(world.rows(300))  # three records of 100 one-row predictions
            # then a malformed record of the same version, on the same partition after them
            await ghost.publisher.publish_proto(PREDICTIONS, inference_events.PredictionBatch(),
                                                subject=prediction_subject("ghost", "1"))
        (dead,) = await read_records(platform_settings, PREDICTIONS.dead_letter(platform_settings.topic_prefix), 1)
        headers = dict(dead.headers)
        assert headers["opml_error_type"] == b"InvalidArgument" and headers["opml_error"].startswith(b"predictions:")
        poll_until(lambda: skipped(scorer) == 300, timeout_s=60.0, what="300 predictions of ghost skipped")
        assert "ghost/1" not in {m.name for m in client.list_models()}
        log = scorer.log_path.read_text()
        assert log.count("predictions of 'ghost/1' skipped") == 1, "one line per version, not one per record"


def _status_or_none(client, model: str, version: str):
    try:
        return client.status(model, version)
    except NotFound:
        return None


async def test_labels_submitted_through_the_api_and_the_cli_are_joined_and_bad_rows_refused_at_once(
        stack, world, platform_settings, tmp_path) -> None:
    scorer = stack.scorer().start()
    rows = world.rows(WINDOW * 2)
    with writer(scorer) as client:
        client.register("fraud", "1", stack.context, "reference")
        async with Producer(platform_settings) as producer:
            await producer.queue(rows)  # one-row requests req-0..399
        wait_windows(client, "fraud", "1", 2, process=scorer)

        with pytest.raises(InvalidArgument) as caught:
            client.submit_labels("fraud", [("", [1.0], None), ("req-0", [], None), ("req-1", [0.5], None),
                                           ("req-2", [float("nan")], None), ("req-3", [1.0], None),
                                           ("req-3", [0.0], None)], version="1")
        assert [f for f, _ in caught.value.violations] == [
            "labels[0].request_id", "labels[1].values", "labels[2].values", "labels[3].values",
            "labels[5].request_id"]
        with pytest.raises(InvalidArgument) as caught:
            client.submit_labels("fraud", [(f"r-{i}", [1.0], None) for i in range(1001)])
        assert caught.value.field == "labels"
        with pytest.raises(NotFound):
            client.submit_labels("nobody", [("req-0", [1.0], None)])
        with pytest.raises(NotFound):
            client.submit_labels("fraud", [("req-0", [1.0], None)], version="9")

        # window 0 through the API, window 1 through the CLI (a CSV for half, a JSONL for the rest)
        assert client.submit_labels("fraud", [(f"req-{i}", producer.labels[f"req-{i}"], None)
                                              for i in range(WINDOW)], version="1") == WINDOW
        csv_file, jsonl_file = tmp_path / "labels.csv", tmp_path / "labels.jsonl"
        csv_file.write_text("request_id,label\n" + "".join(f"req-{i},{int(producer.labels[f'req-{i}'][0])}\n"
                                                           for i in range(WINDOW, WINDOW + 100)))
        jsonl_file.write_text("".join(json.dumps({"request_id": f"req-{i}", "label": producer.labels[f"req-{i}"],
                                                  "time": "2026-01-02T03:04:05+00:00"}) + "\n"
                                      for i in range(WINDOW + 100, WINDOW * 2)))
        cli = CliRunner()
        base = ["--target", scorer.target, "--token", TOKENS["writer"]]
        for path in (csv_file, jsonl_file):
            sent = cli.invoke(monitor, [*base, "label", "fraud", "--file", str(path), "--version", "1"])
            assert sent.exit_code == 0 and "sent 100 labels of fraud" in sent.output, sent.output

        labelled = wait_labelled(client, "fraud", "1", [0, 1])
        for w in labelled:
            window = slice(w.index * WINDOW, (w.index + 1) * WINDOW)
            assert w.true_value == pytest.approx(performance(world.task, rows.outputs.predicted[window],
                                                             rows.labels[window]))

        bad = tmp_path / "bad.csv"
        bad.write_text("request_id,label\nreq-0,cat\n,1\nreq-2,1\nreq-3,inf\n")
        refused = cli.invoke(monitor, [*base, "label", "fraud", "--file", str(bad)])
        assert refused.exit_code != 0
        for line in ("line 2: label 'cat' is not a number", "line 3: request_id", "line 5: label 'inf'"):
            assert line in refused.output, refused.output
        assert "nothing sent, 3 problems" in refused.output

        # labels of the window still open: the truth so far, through the API, before it closes
        opened = world.rows(30)
        async with Producer(platform_settings) as later:
            later.sent = WINDOW * 2  # req-400..429, in window 2
            await later.queue(opened)
        assert client.submit_labels("fraud", [(request_id, values, None) for request_id, values
                                              in later.labels.items()], version="1") == 30

        def open_window_labelled():
            first = next(iter(client.windows("fraud", "1", page_size=10, include_open=True)), None)
            return first if first is not None and first.open and first.labelled == 30 else None

        first = poll_until(open_window_labelled, timeout_s=120, what="the open window's 30 labels")
        assert first.index == 2 and first.rows == 0
        assert first.true_value == pytest.approx(performance(world.task, opened.outputs.predicted, opened.labels))
        assert [w.index for w in client.windows("fraud", "1", page_size=10)] == [1, 0], "not without include_open"
