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
from opml_common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, PermissionDenied, Unauthenticated
from opml_devstack.testing.bus import read_records
from opml_devstack.testing.metrics import samples, scrape
from opml_devstack.testing.services import TOKENS
from opml_fl_coordinator_contract.client import FederatedClient, FederationClient, run_client
from opml_fl_coordinator_contract.names import CLIENT_TOKEN_HEADER
from opml_fl_coordinator_contract.topics import FEDERATIONS
from opml_fl_coordinator_contract.weights import chunks

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
        wrong.join(10)
    with FederatedClient(coordinator.target, "one", "flc_forged", token=TOKENS["reader"]) as forged, \
            pytest.raises(Unauthenticated, match="client token"):
        forged.join(10)
    # registering again replaces the token: the old one stops working
    writer.register_client("one", "plant-1")
    with FederatedClient(coordinator.target, "one", token, token=TOKENS["reader"]) as stale, \
            pytest.raises(Unauthenticated):
        stale.join(10)
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
        raw.join(10)
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


def test_a_member_claims_no_more_examples_than_it_declared_when_it_joined(coordinator, writer):
    """A security review's member claimed 10,000,000 examples and was accepted: the claim is now
    bounded by the member's declaration at Join (itself at most validation.max_examples) times the
    task's epochs, and a larger one is INVALID_ARGUMENT naming the field and both numbers."""
    writer.create("name: claims\nrounds: 2\nmin_clients: 1\nround_deadline_s: 30\nselection: {clients_per_round: 1}\n"
                  "local: {epochs: 2}\nvalidation: {max_examples: 1000}\n")
    token = writer.register_client("claims", "m").token
    with FederatedClient(coordinator.target, "claims", token, token=TOKENS["reader"]) as member:
        for undeclared in (0, 1001):
            with pytest.raises(InvalidArgument) as caught:
                member.join(undeclared)
            assert caught.value.violations == (("num_examples", "the examples a client trains on must be in [1, 1000] "
                                                f"(validation.max_examples), but got {undeclared}"),)
        with pytest.raises(FailedPrecondition, match="must join before it pulls"):
            member.pull(1.0)
        member.join(100)
        header, _ = member.pull()
        assert header.kind == pb.TASK_KIND_INIT and member.upload(header.task_id, [np.zeros(4, np.float32)], 0, {}).accepted
        header, weights = member.pull()
        with pytest.raises(InvalidArgument) as caught:
            member.upload(header.task_id, weights, 10_000_000, {})
        assert caught.value.violations == (("header.num_examples", "must be in [1, 200] (100 declared at join x 2 "
                                                                   "epochs), but got 10000000"),)
        header, weights = member.pull()  # the refusal closed round 1 at once
        assert header.round == 2 and member.upload(header.task_id, weights, 200, {}).accepted
    first, second = writer.rounds("claims")
    assert first.rejected == {"m": "num_examples must be in [1, 200] (100 declared at join x 2 epochs), but got "
                                    "10000000"} and not first.aggregated
    assert second.participants == ["m"] and second.num_examples == 200


def _memory_kib(pid: int, field: str) -> int:
    """VmRSS (now) or VmHWM (the peak since the last reset) of a process, in KiB."""
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(f"{field}:"))


def _received_bytes(coordinator) -> float:
    page = scrape(coordinator.env["OPML_FL_COORDINATOR_METRICS_PORT"])
    return next(s.value for s in samples(page) if s.name == "opml_fl_coordinator_weights_received_bytes_total")


def test_an_upload_past_the_models_shapes_is_refused_as_it_arrives(coordinator, writer):
    """A security review uploaded 512 MiB of 'update' and the coordinator held it all (93 -> 1,109
    MiB). Now each chunk is checked against the task's model as it arrives: 256 MiB sent against an
    8 MiB model is refused at its first chunk, and the coordinator's peak memory rises by less than
    4x the model's size (peak RSS reset just before, read after); a member has one upload open at a
    time, so that bound is per member with a task."""
    model = [np.zeros(2 << 20, np.float32)]  # 8 MiB
    writer.create("name: big\nrounds: 1\nmin_clients: 2\nround_deadline_s: 60\nselection: {clients_per_round: 2}\n")
    tokens = {m: writer.register_client("big", m).token for m in ("m0", "m1")}
    with FederatedClient(coordinator.target, "big", tokens["m0"], token=TOKENS["reader"]) as attacker, \
            FederatedClient(coordinator.target, "big", tokens["m1"], token=TOKENS["reader"]) as honest:
        attacker.join(100)
        honest.join(100)
        header, _ = attacker.pull()
        assert header.kind == pb.TASK_KIND_INIT and attacker.upload(header.task_id, model, 0, {}).accepted
        header, weights = attacker.pull()
        honest_task, honest_weights = honest.pull()  # round 1 waits for m1's answer: nothing is saved meanwhile

        pid, received = coordinator.process.pid, _received_bytes(coordinator)
        before = _memory_kib(pid, "VmRSS")
        with open(f"/proc/{pid}/clear_refs", "w") as clear:
            clear.write("5")  # the peak RSS starts again from now
        with pytest.raises(InvalidArgument) as caught:
            attacker.upload(header.task_id, [np.zeros(64 << 20, np.float32)], 100, {})  # 256 MiB
        assert caught.value.field == "chunk.shape" and "has shape [2097152], but got [67108864]" in caught.value.message
        risen = (_memory_kib(pid, "VmHWM") - before) * 1024
        assert risen < 4 * model[0].nbytes, f"the coordinator's peak RSS rose {risen / 2**20:.0f} MiB"
        assert _received_bytes(coordinator) == received  # not one byte of it went into an array

        # one upload per member at a time: a second stream while the first is open is refused
        opened, release = threading.Event(), threading.Event()
        metadata = ((CLIENT_TOKEN_HEADER, tokens["m1"]),)
        update = pb.UpdateHeader(federation="federations/big", task_id=honest_task.task_id, num_examples=100,
                                 num_arrays=1)

        def slow_upload():
            pieces = chunks(honest_weights, 128 << 10)
            yield pb.UpdateChunk(header=update)
            yield pb.UpdateChunk(chunk=next(pieces))
            opened.set()
            release.wait()
            yield from (pb.UpdateChunk(chunk=piece) for piece in pieces)

        replies = []
        first = threading.Thread(target=lambda: replies.append(honest.stub.UploadUpdate(slow_upload(),
                                                                                         metadata=metadata)))
        first.start()
        opened.wait()
        while _received_bytes(coordinator) == received and first.is_alive():  # until it reads the first stream
            first.join(0.05)
        with pytest.raises(FailedPrecondition, match="already uploading"):
            honest.upload(honest_task.task_id, honest_weights, 100, {})
        release.set()
        first.join()
        assert replies[0].accepted, replies[0].reason
    (round_,) = writer.rounds("big")
    assert round_.participants == ["m1"] and "upload refused: chunk.shape" in round_.rejected["m0"]
