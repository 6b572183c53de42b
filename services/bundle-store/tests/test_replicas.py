"""Two bundle-store processes, each with its own home, serving one context shared through a real S3
remote (the devstack's): the remote is the truth for committed bundles, so a commit on either is
seen by both, concurrent commits of the same names lose and duplicate nothing, and a retried add
with the same idempotency key adds one bundle whichever replica it reaches."""

from __future__ import annotations

import hashlib
import json
import secrets
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from opml_bundle_store_contract.client import BundleStoreClient
from opml_common.errors import InvalidArgument
from opml_devstack.testing.services import TOKENS, ServiceStarter

CONTEXT = "models"
NAMES = ("classifier", "detector", "segmenter")
ADDS_PER_NAME_AND_REPLICA = 6


@pytest.fixture
def replicas(start_service: ServiceStarter, remote_url: str) -> list[BundleStoreClient]:
    shared = {"OPML_BUNDLE_STORE_SHARED_CONTEXTS": json.dumps({CONTEXT: remote_url}),
              "OPML_BUNDLE_STORE_MANIFEST_KEYS": secrets.token_hex(32),
              "OPML_BUNDLE_STORE_GRANT_KEYS": secrets.token_hex(32)}
    processes = [start_service("bundle-store", extra_env=shared) for _ in range(2)]
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
