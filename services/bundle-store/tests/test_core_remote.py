"""Integration tests of push, pull, delete and gc against the session's real S3 (SeaweedFS).

Data stays small (a few MiB, 5 MiB parts: the S3 minimum) so the whole module runs in seconds.
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from minio import Minio
from opml.bundles.v1 import events_pb2

from opml_bundle_store.core import BundleStore, TransferProgress, grants
from opml_bundle_store.core import remote as remote_module
from opml_bundle_store.core import store as store_module
from opml_bundle_store.core import sync as sync_module
from opml_bundle_store.core.layout import ContextDir
from opml_bundle_store.core.remote import S3Remote
from opml_bundle_store.core.signing import ManifestKeys
from opml_common.config import PlatformSettings
from opml_common.errors import DataLoss, FailedPrecondition, NotFound, Unavailable
from opml_common.events import RecordingEmitter
from opml_common.storage import s3_client

HERE = Path(__file__).parent
MIB = 1024 * 1024
KEYS = ManifestKeys(["k" * 64])  # what every store sharing a remote holds
SMALL_STORE = {"part_size": 5 * MIB, "multipart_threshold": 5 * MIB, "range_size": 4 * MIB, "transfer_workers": 8,
               "manifest_keys": KEYS}


@pytest.fixture
def s3(platform_settings: PlatformSettings) -> Minio:
    return s3_client(platform_settings)


@pytest.fixture
def remote_url(unique_prefix: str) -> str:
    return f"s3://{unique_prefix}bundles".rstrip("-") + "/team/contexts"


@pytest.fixture
def stores(tmp_path: Path, s3: Minio, remote_url: str) -> Iterator[tuple[BundleStore, BundleStore]]:
    """Two stores (two homes) bound to the same remote, as two machines would be."""
    with BundleStore(tmp_path / "a", s3, **SMALL_STORE) as a, BundleStore(tmp_path / "b", s3, **SMALL_STORE) as b:
        a.create_context("ctx", remote_url)
        b.create_context("ctx", remote_url)
        yield a, b


def add(store: BundleStore, name: str, files: dict[str, bytes], *, commit: bool = True, **kwargs):
    with store.new_bundle("ctx", name, **kwargs) as writer:
        for path, data in files.items():
            writer.add_file(path, [data])
        return writer.finish(commit=commit)


def read(store: BundleStore, ref: str, path: str) -> bytes:
    return b"".join(store.open_file("ctx", ref, path))


def remote_keys(s3: Minio, url: str, part: str) -> list[str]:
    remote = S3Remote(s3, url)
    prefix = remote.objects_prefix if part == "objects" else remote.bundles_prefix
    return sorted(obj.key for obj in remote.list_objects(prefix))


class Counter:
    """Counts (thread-safely) the calls of a patched S3Remote method."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self._lock = threading.Lock()

    def add(self, *item) -> int:
        with self._lock:
            self.calls.append(item)
            return len(self.calls)


def count_blob_puts(monkeypatch) -> Counter:
    counter = Counter()
    original = S3Remote.put_bytes

    def put_bytes(self, key, data, **kwargs):
        if "/objects/" in f"/{key}":
            counter.add(key)
        return original(self, key, data, **kwargs)

    monkeypatch.setattr(S3Remote, "put_bytes", put_bytes)
    return counter


# -- round trip ---------------------------------------------------------------------------------------------


def test_push_pull_round_trip_across_two_stores(stores, s3: Minio, remote_url: str, monkeypatch) -> None:
    a, b = stores
    big = os.urandom(12 * MIB + 123)  # multipart up (3 parts), ranged down
    files = {"model.onnx": big, "cfg/params.json": b'{"lr": 0.1}', "empty": b"",
             **{f"shards/{i:03d}.bin": os.urandom(1000 + i) for i in range(40)}}
    v1 = add(a, "model", files, tags={"stage": "prod"}, values={"acc": 0.93, "raw": b"\x00"})
    v2 = add(a, "model", {"model.onnx": big, "notes.txt": b"v2"})  # shares the big blob
    add(a, "draft", {"x": b"uncommitted"}, commit=False)
    progress: list[TransferProgress] = []

    pushed = a.push("ctx", progress=progress.append)
    assert [p.uuid for p in pushed] == [v1.uuid, v2.uuid]
    assert all(p.remote_url == remote_url for p in pushed)
    assert progress[-1] == TransferProgress(44, 44, sum(map(len, files.values())) + 2,
                                            sum(map(len, files.values())) + 2)
    assert len(remote_keys(s3, remote_url, "objects")) == 44  # deduplicated across bundles
    assert len(remote_keys(s3, remote_url, "bundles")) == 2  # the uncommitted draft stays local
    assert a.push("ctx") == []  # nothing left to push

    counter = count_blob_puts(monkeypatch)
    assert [p.uuid for p in a.push("ctx", "model")] == [v2.uuid]  # explicit re-push: blobs skipped
    assert counter.calls == []

    pulled_progress: list[TransferProgress] = []
    pulled = b.pull("ctx", localize=True, progress=pulled_progress.append)
    assert {p.uuid for p in pulled} == {v1.uuid, v2.uuid}
    assert pulled_progress[-1].files_done == pulled_progress[-1].files_total == 44
    got = b.get_bundle("ctx", v1.uuid)
    assert got.localized and got.committed and got.context == "ctx" and got.remote_url == remote_url
    assert (got.files, dict(got.values), dict(got.tags), got.content_hash, got.create_time) == (
        v1.files, dict(v1.values), dict(v1.tags), v1.content_hash, v1.create_time)
    for path, data in files.items():
        assert read(b, v1.uuid, path) == data
    assert read(b, "model", "notes.txt") == b"v2"
    home_b = ContextDir(b.home / "contexts" / "ctx")
    for entry in got.files:  # the stored blobs themselves are byte-identical
        assert hashlib.sha256(home_b.blob_path(entry.sha256).read_bytes()).hexdigest() == entry.sha256
    assert list(home_b.tmp.iterdir()) == []
    assert b.pull("ctx", localize=True) == []  # idempotent


def test_metadata_only_pull_then_localize(stores) -> None:
    a, b = stores
    data = os.urandom(7 * MIB)
    first = add(a, "data", {"big.bin": data, "small.txt": b"hello"})
    second = add(a, "other", {"o.txt": b"other"})
    a.push("ctx")

    pulled = b.pull("ctx", "data")
    assert [p.uuid for p in pulled] == [first.uuid] and not pulled[0].localized
    with pytest.raises(FailedPrecondition, match="not localized"):
        b.open_file("ctx", "data", "small.txt")
    assert b.get_bundle("ctx", "data").files == first.files
    with pytest.raises(NotFound):
        b.get_bundle("ctx", second.uuid)  # only that name was pulled

    localized = b.pull("ctx", "data", localize=True)
    assert [(p.uuid, p.localized) for p in localized] == [(first.uuid, True)]
    assert read(b, "data", "big.bin") == data
    assert b.pull("ctx", localize=True)[0].uuid == second.uuid


def test_a_blob_a_gc_removes_before_the_pull_records_it_leaves_the_bundle_not_localized(
        stores, monkeypatch: pytest.MonkeyPatch) -> None:
    """A gc (``--grace 0``) running between a pull's download and its record removes the downloaded,
    still unreferenced blob: the pull must not record the bundle localized (its reads would then fail
    DATA_LOSS); pulled again, it is."""
    a, b = stores
    first = add(a, "data", {"w.bin": b"weights", "c.txt": b"config"})
    a.push("ctx")
    download = sync_module.Downloader.download

    def download_then_gc(self, needed):
        stats = download(self, needed)
        b.gc("ctx", grace_s=0)  # the blobs are referenced by no manifest here yet: removed
        return stats

    monkeypatch.setattr(sync_module.Downloader, "download", download_then_gc)
    pulled = b.pull("ctx", localize=True)
    assert [(p.uuid, p.localized) for p in pulled] == [(first.uuid, False)]
    with pytest.raises(FailedPrecondition, match="not localized"):
        b.open_file("ctx", "data", "w.bin")
    monkeypatch.setattr(sync_module.Downloader, "download", download)
    assert [(p.uuid, p.localized) for p in b.pull("ctx", localize=True)] == [(first.uuid, True)]
    assert read(b, "data", "w.bin") == b"weights"


def test_pull_into_the_store_that_pushed_needs_no_download(stores, monkeypatch) -> None:
    a, _ = stores
    add(a, "m", {"f": b"x"})
    a.push("ctx")
    a.set_remote("ctx", a.get_context("ctx").remote_url)  # same remote: already there
    assert a.pull("ctx", localize=True) == []


# -- corruption ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["small", "ranged"])
def test_corrupted_remote_blob_is_detected_on_pull(stores, s3: Minio, remote_url: str, which: str) -> None:
    a, b = stores
    small, ranged = b"precious bytes", os.urandom(6 * MIB)
    bundle = add(a, "model", {"weights.bin": small, "big/weights.bin": ranged})
    a.push("ctx")
    target = bundle.file("weights.bin" if which == "small" else "big/weights.bin")
    evil = b"evil bytes!!!!" if which == "small" else os.urandom(6 * MIB)  # same size: only the hash tells
    remote = S3Remote(s3, remote_url)
    s3.put_object(remote.bucket, remote.blob_key(target.sha256), io.BytesIO(evil), len(evil))

    with pytest.raises(DataLoss) as caught:
        b.pull("ctx", localize=True)
    message = str(caught.value)
    assert "'model'" in message and bundle.uuid in message and repr(target.path) in message
    assert target.sha256 in message and hashlib.sha256(evil).hexdigest() in message
    assert b.list_bundles("ctx") == []  # nothing became visible
    home_b = ContextDir(b.home / "contexts" / "ctx")
    assert not home_b.blob_path(target.sha256).exists()
    assert list(home_b.tmp.iterdir()) == []


def test_corrupted_or_missing_remote_manifest_and_blob(stores, s3: Minio, remote_url: str) -> None:
    a, b = stores
    bundle = add(a, "model", {"f": b"content"})
    a.push("ctx")
    remote = S3Remote(s3, remote_url)
    key = remote.manifest_key("model", bundle.uuid)
    tampered = bundle.to_json(local_state=False).replace(b'"content_hash": "', b'"content_hash": "0')
    remote.put_manifest(key, tampered, signature=KEYS.sign("model", bundle.uuid, tampered))  # by a key holder
    assert b.pull("ctx") == [] and b.list_bundles("ctx") == []  # the tampered manifest is skipped
    with pytest.raises(DataLoss, match="content_hash"):  # a remote gc removes nothing on its word
        b.gc("ctx", remote=True, grace_s=0)
    data = bundle.to_json(local_state=False)
    remote.put_manifest(key, data, signature=KEYS.sign("model", bundle.uuid, data))
    s3.remove_object(remote.bucket, remote.blob_key(bundle.files[0].sha256))
    with pytest.raises(DataLoss, match="has no object"):
        b.pull("ctx", localize=True)


# -- interrupted pushes ---------------------------------------------------------------------------------------


def test_killed_push_leaves_no_remote_bundle_and_the_next_push_completes_it(
    tmp_path: Path, s3: Minio, remote_url: str, settings_env: dict[str, str], monkeypatch, caplog,
) -> None:
    home = tmp_path / "home"
    files = {f"f/{i:03d}": os.urandom(2048) + bytes([i]) for i in range(60)}
    with BundleStore(home, s3, **SMALL_STORE) as store:
        store.create_context("ctx", remote_url)
        bundle = add(store, "data", files)
    remote = S3Remote(s3, remote_url)
    sizes = {remote.blob_key(entry.sha256): entry.size for entry in bundle.files}
    bundle_blobs = set(sizes)
    assert len(bundle_blobs) == 60
    child = subprocess.run(
        [sys.executable, str(HERE / "core_child.py"), "push", str(home), "ctx", "20"],
        check=False, capture_output=True, text=True, timeout=120, env={**os.environ, **settings_env},
    )
    assert child.returncode == -9, child.stdout + child.stderr  # SIGKILLed mid-push
    # The 20 uploads the child saw confirmed are there; uploads it had in flight when it died (at
    # most its 3 other transfer threads) may still land at any time, as S3 finishes a request
    # whose client is gone. So no exact count is taken here, and none is compared later.
    uploaded = set(remote_keys(s3, remote_url, "objects"))
    assert uploaded <= bundle_blobs and 20 <= len(uploaded) < 60
    assert remote_keys(s3, remote_url, "bundles") == []  # the manifest goes last: nothing visible

    with BundleStore(tmp_path / "reader", s3, **SMALL_STORE) as reader:
        reader.create_context("ctx", remote_url)
        assert reader.pull("ctx", localize=True) == []

        # What the re-push itself saw and did: the blobs its lookups found on the remote, the
        # blobs it PUT, and its own report (the TransferStats it logs).
        found_present: set[str] = set()
        original_stat, original_list_blobs = S3Remote.stat, S3Remote.list_blobs

        def stat(self, key):
            found = original_stat(self, key)
            if found is not None and found.size == sizes.get(key):
                found_present.add(key)
            return found

        def list_blobs(self):
            listed = original_list_blobs(self)
            found_present.update(self.blob_key(sha) for sha, obj in listed.items()
                                 if obj.size == sizes.get(self.blob_key(sha)))
            return listed

        before_repush = set(remote_keys(s3, remote_url, "objects"))  # all of these are there to stay
        progress: list[TransferProgress] = []
        with monkeypatch.context() as patched, BundleStore(home, s3, **SMALL_STORE) as store:
            sent = count_blob_puts(patched)
            patched.setattr(S3Remote, "stat", stat)
            patched.setattr(S3Remote, "list_blobs", list_blobs)
            assert store.get_bundle("ctx", "data").remote_url is None  # not marked pushed
            with caplog.at_level("INFO", logger="opml_bundle_store.core.sync"):
                assert [p.uuid for p in store.push("ctx", progress=progress.append)] == [bundle.uuid]
        sent_keys = [key for (key,) in sent.calls]
        (stats,) = [r.args[-1] for r in caplog.records if r.getMessage().startswith("pushed 1 bundles of ctx")]

        assert len(sent_keys) == len(set(sent_keys)) == stats.blobs_sent  # each missing blob sent once
        assert set(sent_keys) == bundle_blobs - found_present  # exactly the blobs the push found missing
        assert not set(sent_keys) & before_repush  # blobs already up were not sent again
        assert len(sent_keys) <= 60 - len(before_repush)
        assert stats.blobs_sent + stats.blobs_skipped == stats.blobs_total == 60
        total = sum(map(len, files.values()))
        assert progress[-1] == TransferProgress(60, 60, total, total)  # every blob confirmed
        assert set(remote_keys(s3, remote_url, "objects")) == bundle_blobs
        assert remote_keys(s3, remote_url, "bundles") == [remote.manifest_key("data", bundle.uuid)]
        pulled = reader.pull("ctx", localize=True)
        assert [p.uuid for p in pulled] == [bundle.uuid]
        assert all(read(reader, "data", path) == data for path, data in files.items())


def test_multipart_upload_resumes_without_resending_parts(stores, s3: Minio, remote_url: str, monkeypatch) -> None:
    a, b = stores
    data = os.urandom(21 * MIB)  # five parts of 5 MiB (the last 1 MiB)
    bundle = add(a, "big", {"model.bin": data})
    sha = bundle.files[0].sha256
    parts = Counter()
    original = S3Remote.upload_part

    def failing_upload_part(self, key, upload_id, number, chunk):
        if parts.add(number) > 2:
            raise Unavailable("injected: the network went away")
        return original(self, key, upload_id, number, chunk)

    monkeypatch.setattr(S3Remote, "upload_part", failing_upload_part)
    with pytest.raises(Unavailable, match="injected"):
        a.push("ctx")
    state = ContextDir(a.home / "contexts" / "ctx").upload_state_path(sha)
    assert state.exists()  # the upload id is remembered locally
    remote = S3Remote(s3, remote_url)
    import json

    upload_id = json.loads(state.read_bytes())["upload_id"]
    already = remote.list_parts(remote.blob_key(sha), upload_id)
    assert len(already) == 2
    assert remote.stat(remote.blob_key(sha)) is None and remote_keys(s3, remote_url, "bundles") == []

    resent = Counter()

    def counting_upload_part(self, key, upload_id, number, chunk):
        resent.add(number)
        return original(self, key, upload_id, number, chunk)

    monkeypatch.setattr(S3Remote, "upload_part", counting_upload_part)
    progress: list[TransferProgress] = []
    a.push("ctx", progress=progress.append)
    assert sorted(number for (number,) in resent.calls) == sorted(set(range(1, 6)) - set(already))
    assert not state.exists()
    assert remote.stat(remote.blob_key(sha)).size == len(data)
    assert progress[-1].bytes_done == progress[-1].bytes_total == len(data)
    b.pull("ctx", localize=True)
    assert read(b, "big", "model.bin") == data


def test_stale_upload_state_falls_back_to_a_new_upload(stores, s3: Minio, remote_url: str) -> None:
    a, b = stores
    data = os.urandom(6 * MIB)
    bundle = add(a, "big", {"m.bin": data})
    state = ContextDir(a.home / "contexts" / "ctx").upload_state_path(bundle.files[0].sha256)
    remote = S3Remote(s3, remote_url)
    state.write_text(f'{{"bucket": "{remote.bucket}", "key": "{remote.blob_key(bundle.files[0].sha256)}", '
                     f'"upload_id": "no-such-upload", "part_size": {5 * MIB}, "size": {len(data)}}}')
    a.push("ctx")
    b.pull("ctx", localize=True)
    assert read(b, "big", "m.bin") == data


def test_push_preconditions(stores) -> None:
    a, _ = stores
    draft = add(a, "draft", {"f": b"x"}, commit=False)
    with pytest.raises(FailedPrecondition, match="not committed"):
        a.push("ctx", draft.uuid)
    a.set_remote("ctx", None)
    with pytest.raises(FailedPrecondition, match="no remote"):
        a.push("ctx")


def test_push_and_remote_delete_are_announced(tmp_path: Path, s3: Minio, remote_url: str) -> None:
    a_events, b_events = RecordingEmitter(), RecordingEmitter()
    with BundleStore(tmp_path / "a", s3, events=a_events, **SMALL_STORE) as a, \
            BundleStore(tmp_path / "b", s3, events=b_events, **SMALL_STORE) as b:
        a.create_context("ctx", remote_url)
        b.create_context("ctx", remote_url)
        first, second = add(a, "model", {"w": b"1"}), add(a, "model", {"w": b"2"})
        assert [e.type for _, e in a_events.events] == ["opml.bundles.v1.BundleCommitted"] * 2
        assert [p.uuid for p in a.push("ctx")] == [first.uuid, second.uuid]
        pushed = [m for m in a_events.messages if isinstance(m, events_pb2.BundlePushed)]
        assert [(m.bundle.uuid, m.remote_url, m.bundle.remote_url) for m in pushed] == [
            (first.uuid, remote_url, remote_url), (second.uuid, remote_url, remote_url)]
        assert [e.subject for _, e in a_events.events] == ["model"] * 4

        assert b.pull("ctx") and b_events.messages == []  # a pull changes no shared state: no event
        # a uuid only on the remote: its name comes from the remote's listing
        assert b.delete_bundle("ctx", first.uuid) == [first.uuid]
        assert a.delete_bundle("ctx", first.uuid) == [first.uuid]
        assert b.delete_bundle("ctx", first.uuid, remote=True) == [first.uuid]
        assert b_events.messages == [
            events_pb2.BundleDeleted(context="ctx", uuid=first.uuid, bundle_name="model", remote=False),
            events_pb2.BundleDeleted(context="ctx", uuid=first.uuid, bundle_name="model", remote=True)]


# -- delete and gc on the remote -------------------------------------------------------------------------------


def test_remote_delete_and_gc(stores, s3: Minio, remote_url: str) -> None:
    a, b = stores
    keep = add(a, "keep", {"shared": b"shared", "own": b"keep"})
    drop = add(a, "drop", {"shared": b"shared", "gone": b"only in drop"})
    a.push("ctx")
    remote = S3Remote(s3, remote_url)
    stale_upload = remote.create_multipart(remote.blob_key("f" * 64))  # an abandoned upload

    assert a.delete_bundle("ctx", "drop", remote=True) == [drop.uuid]
    assert remote_keys(s3, remote_url, "bundles") == [remote.manifest_key("keep", keep.uuid)]
    with pytest.raises(NotFound):
        a.get_bundle("ctx", drop.uuid)

    young = a.gc("ctx", remote=True)  # default grace of an hour: the fresh blob stays
    assert (young.blobs_removed, young.blobs_kept) == (0, 3)
    dry = a.gc("ctx", remote=True, grace_s=0, dry_run=True)
    assert (dry.blobs_removed, dry.bytes_freed, dry.blobs_kept) == (1, len(b"only in drop"), 2)
    assert len(remote_keys(s3, remote_url, "objects")) == 3
    done = a.gc("ctx", remote=True, grace_s=0)
    assert (done.blobs_removed, done.bytes_freed, done.blobs_kept) == (1, len(b"only in drop"), 2)
    assert len(remote_keys(s3, remote_url, "objects")) == 2
    assert all(upload.upload_id != stale_upload for upload in remote.list_uploads(remote.objects_prefix))

    pulled = b.pull("ctx", localize=True)
    assert [p.uuid for p in pulled] == [keep.uuid] and read(b, "keep", "own") == b"keep"

    # a uuid that exists only on the remote can be deleted there
    assert b.delete_bundle("ctx", keep.uuid) == [keep.uuid]
    assert a.delete_bundle("ctx", keep.uuid, remote=True) == [keep.uuid]
    assert remote_keys(s3, remote_url, "bundles") == []
    with pytest.raises(NotFound):
        b.delete_bundle("ctx", keep.uuid, remote=True)


def test_concurrent_pushes_and_pulls(stores, s3: Minio) -> None:
    a, b = stores
    bundles = [add(a, f"m{i}", {"f": os.urandom(3000), "shared": b"s"}) for i in range(6)]
    errors: list[BaseException] = []

    def run(fn) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - collected, asserted empty
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(lambda i=i: a.push("ctx", f"m{i}"),)) for i in range(6)]
    threads += [threading.Thread(target=run, args=(lambda: b.pull("ctx", localize=True),)) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    b.pull("ctx", localize=True)
    assert {x.uuid for x in b.list_bundles("ctx")} == {x.uuid for x in bundles}
    assert all(x.localized for x in b.list_bundles("ctx"))


def test_unreachable_s3_is_unavailable(tmp_path: Path) -> None:
    from opml_devstack.devinfra import free_port

    settings = PlatformSettings(s3_endpoint=f"http://127.0.0.1:{free_port()}")
    client = s3_client(settings)
    client._http.connection_pool_kw["retries"] = 0
    with BundleStore(tmp_path / "home", client) as store:
        with pytest.raises(Unavailable):
            store.create_context("ctx", "s3://some-bucket/x")
        assert store.list_contexts() == []


def test_remote_module_imports_no_grpc() -> None:
    assert "grpc" not in remote_module.__dict__
    code = "import sys, opml_bundle_store.core; print('grpc' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_a_revocation_is_removed_once_every_grant_it_can_revoke_has_expired(
        tmp_path: Path, s3: Minio, remote_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A revocation need not outlive its grant, and a grant lives at most MAX_TTL_S: the context's next
    revocation removes those older than that, in the context's directory and on its remote."""
    old, recent = "0123456789abcdef", "fedcba9876543210"
    with BundleStore(tmp_path / "home", s3, **SMALL_STORE) as store:
        store.share_context("ctx", remote_url)
        long_ago = datetime.now(UTC) - timedelta(seconds=grants.MAX_TTL_S + 60)
        with monkeypatch.context() as then:
            then.setattr(store_module, "now", lambda: long_ago)
            assert store.revoke_upload_grant("ctx", old) == long_ago

        store.revoke_upload_grant("ctx", recent)

        remote = S3Remote(s3, remote_url)
        assert [obj.key for obj in remote.list_objects(remote.revoked_grants_prefix)] == [
            remote.revoked_grant_key(recent)]
        assert [path.name for path in ContextDir(store.home / "contexts" / "ctx").revoked_grants.iterdir()] \
            == [recent]
        assert store.upload_grant_revoked("ctx", recent) and not store.upload_grant_revoked("ctx", old)
