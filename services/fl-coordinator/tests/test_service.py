"""The fl-coordinator service end to end: a real process, real tansu, S3 and Redis; members in
threads speaking gRPC through the client SDK."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from member import DigitsMember
from opml.fl.v1 import events_pb2
from opml.fl.v1 import fl_pb2 as pb

from opml_common.bus import CloudEvent
from opml_common.errors import AlreadyExists, InvalidArgument, PermissionDenied, Unauthenticated
from opml_devstack.testing.bus import read_records
from opml_devstack.testing.metrics import samples, scrape
from opml_devstack.testing.services import TOKENS
from opml_fl_coordinator_contract.client import FederatedClient, FederationClient, run_client
from opml_fl_coordinator_contract.topics import FEDERATIONS

CONFIG = """
name: {name}
rounds: 4
min_clients: 3
round_deadline_s: 30
selection: {{clients_per_round: 3}}
local: {{epochs: 2, batch_size: 16, learning_rate: 0.2}}
"""


def members(writer, target, federation, count, *, pad=0, behaviours=None):
    """Members in threads; returns a ``finish()`` that waits for them and re-raises a failure."""
    threads, runs, errors = [], {}, []
    for index in range(count):
        token = writer.register_client(federation, f"m{index}").token
        member = DigitsMember(index, count, pad=pad, behaviour=(behaviours or {}).get(index, "normal"))

        def take_part(index=index, token=token, member=member):
            try:
                runs[index] = run_client(target, federation, token, member, token=TOKENS["reader"], wait_s=2.0)
            except BaseException as error:
                errors.append(error)
                with FederationClient(target, token=TOKENS["writer"]) as client:
                    client.stop(federation)  # the others end at once instead of waiting

        threads.append(threading.Thread(target=take_part, daemon=True))
    for thread in threads:
        thread.start()

    def finish():
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return runs

    return finish


def test_a_federation_trains_over_grpc_with_events_and_chunked_weights(coordinator, writer, platform_settings):
    made = writer.create(CONFIG.format(name="digits"))
    assert made.name == "federations/digits" and made.state == pb.FEDERATION_STATE_WAITING
    # 1.2 MB of padding in a model, against a server that takes messages of at most 256 KiB: the
    # model only moves because it moves in chunks
    runs = members(writer, coordinator.target, "digits", 3, pad=300_000, behaviours={2: "nan"})()
    done = writer.get("digits")
    assert done.state == pb.FEDERATION_STATE_COMPLETED and done.completed_rounds == 4
    history = writer.rounds("digits", page_size=3)  # two pages
    assert [r.number for r in history] == [1, 2, 3, 4]
    assert all("m2" in r.rejected and "NaN" in r.rejected["m2"] for r in history)
    assert all(sorted(r.participants) == ["m0", "m1"] for r in history)
    # each member's 4 fits, m2's rejected; whichever member the coordinator asked first (the first to
    # connect: m0 in most runs, not in all) also gave the starting model, one task more, accepted
    assert len(runs[2].rejected) == 4 and sum(run.accepted for run in runs.values()) == 4 + 4 + 1
    assert {runs[0].accepted, runs[1].accepted} <= {4, 5} and runs[2].accepted <= 1
    assert history[-1].metrics["client_accuracy"] > history[0].metrics["client_accuracy"]
    weights = writer.weights("digits")
    assert [w.shape for w in weights] == [(64, 10), (10,), (300_000,)] and np.all(np.isfinite(weights[0]))

    records = asyncio.run(read_records(platform_settings, FEDERATIONS.full_name(platform_settings.topic_prefix), 14))
    events = [CloudEvent.from_kafka(r.headers, r.value) for r in records]
    types = [e.type.removeprefix("opml.fl.v1.") for e in events]
    assert types[0] == "FederationCreated" and types[-1] == "FederationEnded"
    assert types.count("RoundCompleted") == 4 and types.count("UpdateRejected") == 4
    assert all(e.subject == "digits" for e in events)
    completed = [e.parse(events_pb2.RoundCompleted).round for e in events if e.type.endswith("RoundCompleted")]
    assert [r.number for r in completed] == [1, 2, 3, 4]


def test_bad_configs_and_foreign_tokens_are_refused(coordinator, writer):
    with pytest.raises(InvalidArgument) as caught:
        writer.create("name: x\nrounds: -1\nstrategy: {name: fedadam, eta: 0}\nselection: {policy: fastest}\n")
    assert {f for f, _ in caught.value.violations} == {"rounds", "strategy.eta", "selection.policy"}
    writer.create(CONFIG.format(name="one"))
    writer.create(CONFIG.format(name="two"))
    with pytest.raises(AlreadyExists):
        writer.create(CONFIG.format(name="one"))
    with pytest.raises(InvalidArgument) as caught:
        writer.register_client("one", "plant-1\n")
    assert caught.value.field == "client_id"
    token = writer.register_client("one", "plant-1").token
    with FederatedClient(coordinator.target, "two", token, token=TOKENS["reader"]) as wrong, \
            pytest.raises(PermissionDenied, match="another federation"):
        wrong.join()
    with FederatedClient(coordinator.target, "one", "flc_forged", token=TOKENS["reader"]) as forged, \
            pytest.raises(Unauthenticated, match="client token"):
        forged.join()
    # registering again replaces the token: the old one stops working
    writer.register_client("one", "plant-1")
    with FederatedClient(coordinator.target, "one", token, token=TOKENS["reader"]) as stale, \
            pytest.raises(Unauthenticated):
        stale.join()
    with FederationClient(coordinator.target, token=TOKENS["reader"]) as reader:
        with pytest.raises(PermissionDenied, match="writer"):
            reader.create(CONFIG.format(name="three"))
        assert [f.name for f in reader.list()] == ["federations/one", "federations/two"]
    assert writer.stop("two").state == pb.FEDERATION_STATE_STOPPED


def test_a_member_leaves_out_a_non_finite_metric_and_keeps_taking_part(coordinator, writer):
    """An older coordinator refused a whole upload for one NaN metric (a diverged loss): a member that
    sent it was refused as a caller and stopped."""
    writer.create("name: nanloss\nrounds: 2\nmin_clients: 2\nround_deadline_s: 30\n"
                  "selection: {clients_per_round: 2}\n")
    runs = members(writer, coordinator.target, "nanloss", 2, behaviours={1: "nan-metric"})()
    assert runs[1].accepted >= 2 and not runs[1].rejected
    assert writer.get("nanloss").state == pb.FEDERATION_STATE_COMPLETED


def test_a_non_finite_metric_from_a_client_without_the_sdk_is_left_out_of_its_update(coordinator, writer):
    """The update is taken, the metric dropped (logged, counted): the call is not refused for it."""
    writer.create("name: rawnan\nrounds: 1\nmin_clients: 1\nround_deadline_s: 30\n"
                  "selection: {clients_per_round: 1}\n")
    token = writer.register_client("rawnan", "raw").token
    with FederatedClient(coordinator.target, "rawnan", token, token=TOKENS["reader"]) as raw:
        raw.join()
        header, _ = raw.pull()
        assert header.kind == pb.TASK_KIND_INIT
        assert raw.upload(header.task_id, [np.zeros((3, 2), np.float32)], 0, {"init_loss": float("inf")}).accepted
        header, weights = raw.pull()
        assert header.kind == pb.TASK_KIND_FIT
        reply = raw.upload(header.task_id, weights, 10, {"train_loss": float("nan"), "eval_accuracy": 0.5})
        assert reply.accepted, reply.reason
    (round_,) = writer.rounds("rawnan")
    assert "train_loss" not in round_.metrics and all(np.isfinite(v) for v in round_.metrics.values())
    page = scrape(coordinator.env["OPML_FL_COORDINATOR_METRICS_PORT"])
    assert any(s.name == "opml_fl_coordinator_update_metrics_dropped_total" and s.value == 2 for s in samples(page))


def test_semi_async_over_grpc_makes_versions_from_buffered_updates(coordinator, writer):
    writer.create("name: buffered\nrounds: 6\nmin_clients: 3\nmode: semi_async\nround_deadline_s: 30\n"
                  "selection: {clients_per_round: 3}\nsemi_async: {buffer_size: 2, concurrency: 3}\n"
                  "strategy: {name: fedadam, eta: 0.05}\n")
    runs = members(writer, coordinator.target, "buffered", 3)()
    history = writer.rounds("buffered")
    assert [r.number for r in history] == [1, 2, 3, 4, 5, 6]
    assert all(len(r.participants) == 2 for r in history)  # each version: a buffer of two updates
    assert sum(run.accepted for run in runs.values()) >= 12  # 12 in versions (+ the starting weights)
    assert writer.get("buffered").state == pb.FEDERATION_STATE_COMPLETED
