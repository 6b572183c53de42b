"""Two bundle-store processes, each with its own home, serving one context shared through a real S3
remote (the devstack's): the remote is the truth for committed bundles, so a commit on either is
seen by both, concurrent commits of the same names lose and duplicate nothing, and a retried add
with the same idempotency key adds one bundle whichever replica it reaches. Uncommitted bundles are
staged there too: what one replica received the other reads and commits, two replicas adding one
key at the same moment add one bundle, and a replica killed mid-add leaves the bundle absent until
the client's retry on the other adds it, once."""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from opml.bundles.v1 import bundles_pb2 as pb

from opml_bundle_store_contract.client import BundleStoreClient
from opml_common.errors import AlreadyExists, InvalidArgument, NotFound, Unauthenticated, Unavailable
from opml_devstack.process import ServiceProcess
from opml_devstack.testing.services import TOKENS, ServiceStarter

CONTEXT = "models"
NAMES = ("classifier", "detector", "segmenter")
ADDS_PER_NAME_AND_REPLICA = 6


@pytest.fixture
def shared_env(start_service: ServiceStarter, remote_url: str) -> list[dict[str, str]]:
    """Each replica's environment: its own home and ports, the same shared context and keys."""
    shared = {"OPML_BUNDLE_STORE_SHARED_CONTEXTS": json.dumps({CONTEXT: remote_url}),
              "OPML_BUNDLE_STORE_MANIFEST_KEYS": secrets.token_hex(32),
              "OPML_BUNDLE_STORE_GRANT_KEYS": secrets.token_hex(32)}
    return [start_service.env("bundle-store", extra_env=shared) for _ in range(2)]


@pytest.fixture
def processes(start_service: ServiceStarter, shared_env: list[dict[str, str]]) -> list[ServiceProcess]:
    return [start_service("bundle-store", env=env) for env in shared_env]


@pytest.fixture
def replicas(processes: list[ServiceProcess]) -> list[BundleStoreClient]:
    clients = [BundleStoreClient(process.target, token=TOKENS["writer"]) for process in processes]
    yield clients
    for client in clients:
        client.close()


def test_concurrent_commits_through_two_replicas_are_each_listed_once_on_both(replicas) -> None:
    def add(replica: int, name: str, n: int):
        weights = f"{name} {replica} {n}".encode() * 1000
        return replicas[replica].add(CONTEXT, name, {"weights.bin": weights, "shared.txt": b"same on every add"},
                                     values={"n": n}, commit=True)

    jobs = [(replica, name, n) for n in range(ADDS_PER_NAME_AND_REPLICA) for name in NAMES for replica in (0, 1)]
    with ThreadPoolExecutor(8) as pool:
        added = list(pool.map(lambda job: add(*job), jobs))
    assert len({bundle.uuid for bundle in added}) == len(jobs)  # each add its own uuid

    listings = [replica.list_bundles(CONTEXT) for replica in replicas]
    for listing in listings:
        assert Counter(b.uuid for b in listing) == Counter(b.uuid for b in added)  # every one, exactly once
        assert all(b.committed for b in listing)
    assert {b.uuid: b.content_hash for b in listings[0]} == {b.uuid: b.content_hash for b in listings[1]} \
        == {b.uuid: b.content_hash for b in added}
    for name in NAMES:  # one order both agree on: the same latest version of every name
        assert replicas[0].get_bundle(CONTEXT, name).uuid == replicas[1].get_bundle(CONTEXT, name).uuid

    on_first = next(b for (replica, _, _), b in zip(jobs, added) if replica == 0)
    read = b"".join(replicas[1].read_file(CONTEXT, on_first.uuid, "weights.bin"))  # fetched on the first read
    assert hashlib.sha256(read).hexdigest() == next(f.sha256 for f in on_first.files if f.path == "weights.bin")


def test_a_retried_add_with_the_same_idempotency_key_adds_one_bundle_on_any_replica(replicas) -> None:
    files = {"model.onnx": b"onnx bytes"}
    first = replicas[0].add(CONTEXT, "retried", files, commit=True, idempotency_key="run-7/model")
    again = replicas[1].add(CONTEXT, "retried", files, commit=True, idempotency_key="run-7/model")
    same_replica = replicas[0].add(CONTEXT, "retried", files, commit=True, idempotency_key="run-7/model")
    other = replicas[1].add(CONTEXT, "retried", files, commit=True, idempotency_key="run-8/model")
    assert again.uuid == same_replica.uuid == first.uuid != other.uuid
    for replica in replicas:
        assert sorted(b.uuid for b in replica.list_bundles(CONTEXT, bundle_name="retried")) == \
            sorted([first.uuid, other.uuid])
    with pytest.raises(InvalidArgument, match=r"header\.idempotency_key"):
        replicas[0].add(CONTEXT, "retried", files, idempotency_key="tab\tseparated")


def test_an_upload_one_replica_received_is_read_and_committed_through_either(replicas) -> None:
    """A trial's upload (its grant's AddBundle, uncommitted) reaches replica A; its issuer reads it and
    commits it through B, and commits it again through A at the same moment: one committed bundle."""
    a, b = replicas
    token = a.create_upload_grant(CONTEXT, "trial-7", ttl_s=600, max_bytes=1 << 20)
    weights = secrets.token_bytes(200_000)
    with BundleStoreClient(a.target, token=token) as holder:
        uploaded = holder.add(CONTEXT, "trial-7", {"model.onnx": weights}, values={"accuracy": 0.91})
    assert not uploaded.committed

    seen = b.get_bundle(CONTEXT, uploaded.uuid)  # B never received it
    assert (seen.committed, seen.content_hash) == (False, uploaded.content_hash)
    assert b"".join(b.read_file(CONTEXT, uploaded.uuid, "model.onnx")) == weights
    assert [x.uuid for x in b.list_bundles(CONTEXT, bundle_name="trial-7")] == [uploaded.uuid]

    barrier = threading.Barrier(2)

    def commit(replica: BundleStoreClient):
        barrier.wait()
        return replica.commit(CONTEXT, uploaded.uuid)

    with ThreadPoolExecutor(2) as pool:
        committed = list(pool.map(commit, (b, a)))
    assert [c.uuid for c in committed] == [uploaded.uuid] * 2 and all(c.committed for c in committed)
    for replica in replicas:
        listed = replica.list_bundles(CONTEXT, bundle_name="trial-7")
        assert [(x.uuid, x.committed, x.content_hash) for x in listed] == [(uploaded.uuid, True, uploaded.content_hash)]
        assert replica.get_bundle(CONTEXT, "trial-7").uuid == uploaded.uuid


@pytest.mark.parametrize("commit", [True, False], ids=["committed", "uncommitted"])
def test_two_replicas_adding_one_idempotency_key_at_the_same_moment_add_one_bundle(replicas, commit: bool) -> None:
    rounds = 8

    def add(job: tuple[int, int, threading.Barrier]):
        replica, n, barrier = job
        barrier.wait()
        return replicas[replica].add(CONTEXT, "raced", {"model.onnx": f"run {n}".encode() * 100},
                                     commit=commit, idempotency_key=f"run-{n}/model")

    added = []
    with ThreadPoolExecutor(2) as pool:
        for n in range(rounds):
            barrier = threading.Barrier(2)
            added.append(list(pool.map(add, [(0, n, barrier), (1, n, barrier)])))
    for on_a, on_b in added:
        assert on_a.uuid == on_b.uuid and on_a.content_hash == on_b.content_hash
        assert on_a.committed == on_b.committed == commit
    for replica in replicas:
        listed = replica.list_bundles(CONTEXT, bundle_name="raced")
        assert Counter(x.uuid for x in listed) == Counter(on_a.uuid for on_a, _ in added)  # each key once
        assert all(x.committed == commit for x in listed)


@pytest.mark.timeout(300)
def test_a_replica_killed_mid_add_leaves_the_bundle_absent_until_the_retry_on_the_other_adds_it_once(
        start_service: ServiceStarter, shared_env: list[dict[str, str]], processes: list[ServiceProcess]) -> None:
    a, b = (BundleStoreClient(process.target, token=TOKENS["writer"]) for process in processes)
    files = {f"shard/{index}.bin": secrets.token_bytes(64 * 1024) for index in range(4)}
    header = pb.AddBundleHeader(
        parent=f"contexts/{CONTEXT}", bundle_name="killed", commit=True, idempotency_key="job-3/attempt",
        files=[pb.BundleFile(path=path, sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data))
               for path, data in files.items()])
    one_file_sent, killed = threading.Event(), threading.Event()

    def requests():
        yield pb.AddBundleRequest(header=header)
        yield pb.AddBundleRequest(chunk=pb.FileChunk(file_index=0, data=files["shard/0.bin"]))
        one_file_sent.set()
        killed.wait()  # the rest never comes from this attempt

    outcome: list[BaseException] = []

    def attempt() -> None:
        try:
            a.stub.AddBundle(requests())
        except BaseException as error:  # noqa: BLE001 - the outcome the test checks
            outcome.append(error)

    thread = threading.Thread(target=attempt)
    thread.start()
    assert one_file_sent.wait(60)
    processes[0].kill()  # SIGKILL, one file of four into the add
    killed.set()
    thread.join()
    assert len(outcome) == 1 and isinstance(outcome[0], Unavailable) and outcome[0].retriable

    assert b.list_bundles(CONTEXT, bundle_name="killed") == []  # cleanly absent
    retried = b.add(CONTEXT, "killed", files, commit=True, idempotency_key="job-3/attempt")
    again = b.add(CONTEXT, "killed", files, commit=True, idempotency_key="job-3/attempt")
    assert again.uuid == retried.uuid and retried.committed

    restarted = start_service("bundle-store", env=shared_env[0])  # A again, over the home it was killed with
    with BundleStoreClient(restarted.target, token=TOKENS["writer"]) as a_again:
        for replica in (a_again, b):
            assert [x.uuid for x in replica.list_bundles(CONTEXT, bundle_name="killed")] == [retried.uuid]
        assert b"".join(a_again.read_file(CONTEXT, "killed", "shard/3.bin")) == files["shard/3.bin"]
    a.close()
    b.close()


def test_an_upload_whose_replica_was_killed_after_it_returned_is_committed_and_read_through_the_other(
        processes: list[ServiceProcess], replicas) -> None:
    a, b = replicas
    weights = secrets.token_bytes(300_000)
    uploaded = a.add(CONTEXT, "orphaned", {"model.onnx": weights})
    processes[0].kill()  # SIGKILL: the replica that received it is gone for good
    committed = b.commit(CONTEXT, uploaded.uuid)
    assert (committed.uuid, committed.committed, committed.content_hash) == (uploaded.uuid, True, uploaded.content_hash)
    assert b"".join(b.read_file(CONTEXT, "orphaned", "model.onnx")) == weights  # its blobs were on S3


@pytest.mark.parametrize("commit", [True, False], ids=["committed", "uncommitted"])
def test_one_idempotency_key_with_different_content_on_two_replicas_at_once_the_first_wins(
        replicas, commit: bool) -> None:
    """Two adds of one key, each with its own content, racing on the two replicas: one wins, the other is
    refused ALREADY_EXISTS naming the key; a retry of the winner's request (on either replica) returns the
    winner's bundle, one of the loser's is refused again; each replica lists the winner's content only."""
    rounds = 6

    def add(job: tuple[int, int, threading.Barrier]):
        replica, n, barrier = job
        barrier.wait()
        try:
            return replicas[replica].add(CONTEXT, "contested", {"model.onnx": f"run {n} on {replica}".encode() * 100},
                                         values={"replica": replica}, commit=commit, idempotency_key=f"run-{n}")
        except AlreadyExists as refused:
            return refused

    with ThreadPoolExecutor(2) as pool:
        for n in range(rounds):
            barrier = threading.Barrier(2)
            outcomes = list(pool.map(add, [(0, n, barrier), (1, n, barrier)]))
            won = [o for o in outcomes if isinstance(o, pb.Bundle)]
            lost = [o for o in outcomes if isinstance(o, AlreadyExists)]
            assert len(won) == 1 and len(lost) == 1, outcomes
            [winner], [refused] = won, lost
            assert f"run-{n}" in refused.message and "differ" in refused.message
            assert winner.committed == commit
            winner_replica = winner.values["replica"].int_value
            for replica in replicas:  # the winner's request again: its bundle, whichever replica
                again = replica.add(CONTEXT, "contested", {"model.onnx": f"run {n} on {winner_replica}".encode() * 100},
                                    values={"replica": winner_replica}, commit=commit, idempotency_key=f"run-{n}")
                assert (again.uuid, again.content_hash) == (winner.uuid, winner.content_hash)
                with pytest.raises(AlreadyExists, match=f"run-{n}"):
                    replica.add(CONTEXT, "contested", {"model.onnx": f"run {n} on {1 - winner_replica}".encode() * 100},
                                values={"replica": 1 - winner_replica}, commit=commit, idempotency_key=f"run-{n}")
                listed = [(x.uuid, x.content_hash, x.committed) for x in replica.list_bundles(CONTEXT)
                          if x.uuid == winner.uuid]
                assert listed == [(winner.uuid, winner.content_hash, commit)]
    for replica in replicas:
        assert len(replica.list_bundles(CONTEXT, bundle_name="contested")) == rounds


def test_one_idempotency_key_with_different_content_on_one_replica_is_refused(replicas) -> None:
    a, _ = replicas
    first = a.add(CONTEXT, "repeated", {"model.onnx": b"first"}, idempotency_key="job-1")
    with pytest.raises(AlreadyExists, match=r"job-1.*differ"):
        a.add(CONTEXT, "repeated", {"model.onnx": b"second"}, idempotency_key="job-1")
    with pytest.raises(AlreadyExists, match=r"job-1.*differ"):
        a.add(CONTEXT, "repeated", {"model.onnx": b"first"}, tags={"other": "tag"}, idempotency_key="job-1")
    assert a.add(CONTEXT, "repeated", {"model.onnx": b"first"}, idempotency_key="job-1").uuid == first.uuid
    assert [x.uuid for x in a.list_bundles(CONTEXT, bundle_name="repeated")] == [first.uuid]


def test_a_grant_revoked_through_one_replica_is_refused_at_once_by_both(processes, replicas) -> None:
    """Revocation lives in the shared context's remote: the grant is refused by the replica that did not
    revoke it, right away, an upload in flight when it was revoked included; other grants go on."""
    a, b = replicas
    issued = a.issue_upload_grant(CONTEXT, "trial-9", ttl_s=600, max_bytes=1 << 20)
    kept = a.create_upload_grant(CONTEXT, "trial-9", ttl_s=600, max_bytes=1 << 20)
    holders = [BundleStoreClient(process.target, token=issued.token) for process in processes]
    uploaded = holders[0].add(CONTEXT, "trial-9", {"model.onnx": b"before"})
    for holder in holders:  # both replicas accept it, and have seen it accepted
        assert [x.uuid for x in holder.list_bundles(CONTEXT, bundle_name="trial-9")] == [uploaded.uuid]

    chunk_sent, revoked = threading.Event(), threading.Event()
    data = b"during" * 1000
    header = pb.AddBundleHeader(parent=f"contexts/{CONTEXT}", bundle_name="trial-9", files=[
        pb.BundleFile(path="model.onnx", sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data))])

    def requests():
        yield pb.AddBundleRequest(header=header)
        yield pb.AddBundleRequest(chunk=pb.FileChunk(file_index=0, data=data[:100]))
        chunk_sent.set()
        revoked.wait()
        yield pb.AddBundleRequest(chunk=pb.FileChunk(file_index=0, data=data[100:]))

    with ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(holders[0].stub.AddBundle, requests())
        assert chunk_sent.wait(60)
        reply = b.revoke_upload_grant(CONTEXT, issued.grant_id)  # through the replica the upload is not on
        revoked.set()
        with pytest.raises(Unauthenticated, match=f"upload grant {issued.grant_id} was revoked"):
            in_flight.result()
    assert reply.grant_id == issued.grant_id and reply.revoke_time.seconds > 0

    for holder in holders:
        calls = {"add": lambda h=holder: h.add(CONTEXT, "trial-9", {"model.onnx": b"after"}),
                 "get": lambda h=holder: h.get_bundle(CONTEXT, uploaded.uuid),
                 "list": lambda h=holder: h.list_bundles(CONTEXT, bundle_name="trial-9")}
        for what, call in calls.items():
            with pytest.raises(Unauthenticated, match=f"upload grant {issued.grant_id} was revoked") as caught:
                call()
            assert issued.token not in caught.value.message, what
        holder.close()
    for replica in (a, b):  # again, through either: the first revocation's time
        again = replica.revoke_upload_grant(CONTEXT, issued.grant_id)
        assert (again.grant_id, again.revoke_time) == (issued.grant_id, reply.revoke_time)
    with BundleStoreClient(b.target, token=kept) as other:  # another grant of the name is not touched
        assert other.add(CONTEXT, "trial-9", {"model.onnx": b"other grant"}).bundle_name == "trial-9"
    listed = {x.content_hash for x in a.list_bundles(CONTEXT, bundle_name="trial-9")}
    assert uploaded.content_hash in listed and len(listed) == 2  # what it uploaded before stays; nothing during
    with pytest.raises(InvalidArgument) as caught:
        a.stub.RevokeUploadGrant(pb.RevokeUploadGrantRequest(parent="models", grant_id="../x"))
    assert {field for field, _ in caught.value.violations} == {"parent", "grant_id"}
    with pytest.raises(NotFound):
        a.revoke_upload_grant("nowhere", issued.grant_id)
    for process in processes:
        assert issued.token not in process.log_path.read_text()
