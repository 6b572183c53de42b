"""A shared context's uncommitted bundles, staged on its remote (the devstack's S3), through two
in-process stores with their own homes: what one store received the other reads and commits, an
idempotency key's adds racing on both stage one bundle, and remote gc removes abandoned staging."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from minio import Minio

from opml_bundle_store.core import BundleStore
from opml_bundle_store.core import gc as gc_module
from opml_bundle_store.core.context import now
from opml_bundle_store.core.remote import S3Remote
from opml_bundle_store.core.signing import ManifestKeys
from opml_common.config import PlatformSettings
from opml_common.errors import AlreadyExists, Unavailable
from opml_common.storage import s3_client

KEYS = ManifestKeys(["s" * 64])


@pytest.fixture
def s3(platform_settings: PlatformSettings) -> Minio:
    return s3_client(platform_settings)


@pytest.fixture
def remote(s3: Minio, unique_prefix: str) -> S3Remote:
    return S3Remote(s3, f"s3://{unique_prefix}staging".rstrip("-") + "/shared")


@pytest.fixture
def stores(tmp_path: Path, s3: Minio, remote: S3Remote) -> Iterator[tuple[BundleStore, BundleStore]]:
    with BundleStore(tmp_path / "a", s3, manifest_keys=KEYS, transfer_workers=4) as a, \
            BundleStore(tmp_path / "b", s3, manifest_keys=KEYS, transfer_workers=4) as b:
        a.share_context("ctx", remote.url)
        b.share_context("ctx", remote.url)
        yield a, b


def add(store: BundleStore, name: str, files: dict[str, bytes], *, commit: bool = False, **kwargs):
    with store.new_bundle("ctx", name, **kwargs) as writer:
        for path, data in files.items():
            writer.add_file(path, [data])
        return writer.finish(commit=commit)


def keys(remote: S3Remote, prefix: str) -> list[str]:
    return sorted(obj.key for obj in remote.list_objects(prefix))


def test_an_uncommitted_bundle_one_store_received_is_read_and_committed_by_the_other(stores, remote) -> None:
    a, b = stores
    added = add(a, "model", {"weights.bin": b"w" * 3000}, values={"epoch": 3})
    assert not added.committed and added.remote_url == remote.url
    assert keys(remote, remote.staging_prefix) == [remote.staged_key("model", added.uuid)]
    assert keys(remote, remote.bundles_prefix) == []

    seen = b.get_bundle("ctx", added.uuid)  # B never received it
    assert (seen.committed, seen.content_hash, seen.values) == (False, added.content_hash, {"epoch": 3})
    assert b"".join(b.open_file("ctx", added.uuid, "weights.bin")) == b"w" * 3000
    assert [x.uuid for x in b.list_bundles("ctx", bundle_name="model")] == [added.uuid]

    committed = b.commit("ctx", added.uuid)
    assert committed.committed and committed.remote_url == remote.url
    assert keys(remote, remote.staging_prefix) == []  # unstaged once the committed manifest is written
    assert keys(remote, remote.bundles_prefix) == [remote.manifest_key("model", added.uuid)]
    on_a = a.get_bundle("ctx", "model")  # A merges the commit it did not make into its own copy
    assert (on_a.uuid, on_a.committed, on_a.localized) == (added.uuid, True, True)
    assert a.commit("ctx", added.uuid).committed  # committing it again where it began: still one bundle
    for store in stores:
        assert [(x.uuid, x.committed) for x in store.list_bundles("ctx")] == [(added.uuid, True)]


@pytest.mark.parametrize("same", [True, False], ids=["same-content", "other-content"])
@pytest.mark.parametrize("commit", [True, False], ids=["committed", "uncommitted"])
def test_two_stores_adding_one_idempotency_key_at_once_stage_one_bundle(stores, remote, commit: bool,
                                                                        same: bool) -> None:
    """The first staged is the key's bundle on both; the other add gets it when it asked for the same
    content, and is refused AlreadyExists when not."""
    rounds = 6
    results: dict[tuple[int, int], object] = {}
    for n in range(rounds):
        barrier = threading.Barrier(2)

        def one(index: int, n: int = n, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            content = f"trial {n}" if same else f"trial {n} from {index}"
            try:
                results[index, n] = add(stores[index], "trial", {"model.onnx": content.encode()},
                                        commit=commit, idempotency_key=f"run/{n}")
            except AlreadyExists as refused:
                results[index, n] = refused

        threads = [threading.Thread(target=one, args=(index,)) for index in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    winners = {}
    for n in range(rounds):
        outcomes = [results[0, n], results[1, n]]
        added = [o for o in outcomes if not isinstance(o, AlreadyExists)]
        refused = [o for o in outcomes if isinstance(o, AlreadyExists)]
        assert len(added) == (2 if same else 1) and len(refused) == (0 if same else 1), outcomes
        assert all(f"'run/{n}'" in o.message and "differs" in o.message for o in refused)
        assert len({(o.uuid, o.content_hash) for o in added}) == 1  # the key makes the uuid, the first staged wins
        assert all(o.committed == commit for o in added)
        winners[n] = added[0]
    for store in stores:
        listed = store.list_bundles("ctx", bundle_name="trial")
        assert sorted(x.uuid for x in listed) == sorted(b.uuid for b in winners.values())
        assert all(x.committed == commit for x in listed)
        for bundle in winners.values():
            data = b"".join(store.open_file("ctx", bundle.uuid, "model.onnx"))
            assert hashlib.sha256(data).hexdigest() == bundle.files[0].sha256
            assert store.get_bundle("ctx", bundle.uuid).content_hash == bundle.content_hash
    manifests = keys(remote, remote.bundles_prefix if commit else remote.staging_prefix)
    assert len(manifests) == rounds
    assert keys(remote, remote.staging_prefix if commit else remote.bundles_prefix) == []


def test_remote_gc_removes_staging_a_commit_left_and_staging_older_than_its_ttl(stores, remote, monkeypatch) -> None:
    a, b = stores
    kept = add(a, "kept", {"f": b"kept"})
    left = add(a, "left", {"f": b"left over"})
    real_delete = S3Remote.delete

    def failing_delete(self, object_keys):
        object_keys = list(object_keys)
        if any("/staging/" in key for key in object_keys):
            raise Unavailable("S3 stopped answering")
        return real_delete(self, object_keys)

    monkeypatch.setattr(S3Remote, "delete", failing_delete)
    with pytest.raises(Unavailable):
        b.commit("ctx", left.uuid)  # the committed manifest is written, its staged one stays
    monkeypatch.setattr(S3Remote, "delete", real_delete)
    assert remote.staged_key("left", left.uuid) in keys(remote, remote.staging_prefix)
    assert a.get_bundle("ctx", left.uuid).committed  # the remote's committed manifest wins

    a.gc("ctx", remote=True, grace_s=0)
    assert keys(remote, remote.staging_prefix) == [remote.staged_key("kept", kept.uuid)]
    assert a.get_bundle("ctx", kept.uuid).content_hash == kept.content_hash  # its blob kept: staged bundles count

    later = now() + timedelta(days=8)  # past the store's staging_ttl_s (7 days)
    monkeypatch.setattr(gc_module, "now", lambda: later)
    report = b.gc("ctx", remote=True, grace_s=0)
    assert keys(remote, remote.staging_prefix) == []
    assert report.blobs_removed == 1  # the abandoned bundle's blob; the committed one's stays
    for store in stores:  # both forget the abandoned bundle, the one that received it too
        assert [x.uuid for x in store.list_bundles("ctx")] == [left.uuid]
