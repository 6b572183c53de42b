"""Unit tests of the bundle store on local disk (no S3): add, commit, list, resolve, read, dedup,
abort and crash recovery, lineage, gc, validation and thread safety."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from opml_bundle_store.core import BundleStore, Lineage
from opml_bundle_store.core.layout import ContextDir
from opml_common.errors import (
    AlreadyExists,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)

HERE = Path(__file__).parent


@pytest.fixture
def store(tmp_path: Path):
    with BundleStore(tmp_path / "home", None) as opened:
        opened.create_context("ctx")
        yield opened


def add(store: BundleStore, name: str, files: dict[str, bytes], *, commit: bool = False, context: str = "ctx",
        **kwargs):
    with store.new_bundle(context, name, **kwargs) as writer:
        for path, data in files.items():
            writer.add_file(path, [data[:3], data[3:]])
        return writer.finish(commit=commit)


def blob_count(store: BundleStore, context: str = "ctx") -> int:
    return len(list(ContextDir(store.home / "contexts" / context).iter_blobs()))


def read(store: BundleStore, ref: str, path: str, context: str = "ctx") -> bytes:
    return b"".join(store.open_file(context, ref, path))


# -- contexts -------------------------------------------------------------------------------------------


def test_contexts(tmp_path: Path) -> None:
    with BundleStore(tmp_path / "home", None) as store:
        info = store.create_context("alpha")
        assert (info.name, info.remote_url, info.bundle_count) == ("alpha", None, 0)
        store.create_context("beta")
        with pytest.raises(AlreadyExists, match="alpha"):
            store.create_context("alpha")
        with pytest.raises(NotFound, match="'gamma'"):
            store.get_context("gamma")
        with pytest.raises(FailedPrecondition, match="no S3 client"):
            store.create_context("remote", "s3://bucket/prefix")
        add(store, "m", {"f": b"x"}, context="beta")
        assert [(c.name, c.bundle_count) for c in store.list_contexts()] == [("alpha", 0), ("beta", 1)]
    with BundleStore(tmp_path / "home", None) as reopened:  # persisted
        assert [c.name for c in reopened.list_contexts()] == ["alpha", "beta"]
        assert reopened.get_context("beta").bundle_count == 1


def test_one_store_per_home(tmp_path: Path) -> None:
    with BundleStore(tmp_path / "home", None), pytest.raises(FailedPrecondition, match="in use"):
        BundleStore(tmp_path / "home", None)
    BundleStore(tmp_path / "home", None).close()  # released on close


# -- add / commit / list / get --------------------------------------------------------------------------


def test_add_commit_list_get(store: BundleStore, tmp_path: Path) -> None:
    lineage = Lineage(code_version="abc", parameters={"lr": "0.1"}, creator="alice")
    bundle = add(store, "model", {"model.onnx": b"weights", "cfg/params.json": b"{}"},
                 tags={"stage": "dev"}, values={"acc": 0.9, "epochs": 3}, lineage=lineage)
    assert not bundle.committed and bundle.commit_time is None and bundle.localized
    assert bundle.context == "ctx" and bundle.remote_url is None
    assert [f.path for f in bundle.files] == ["model.onnx", "cfg/params.json"]
    assert bundle.files[0].sha256 == hashlib.sha256(b"weights").hexdigest() and bundle.files[0].size == 7
    assert bundle.lineage == lineage and dict(bundle.values) == {"acc": 0.9, "epochs": 3}
    assert store.get_bundle("ctx", bundle.uuid) == bundle
    assert read(store, bundle.uuid, "model.onnx") == b"weights"

    committed = store.commit("ctx", bundle.uuid)
    assert committed.committed and committed.commit_time >= committed.create_time
    assert store.commit("ctx", bundle.uuid) == committed  # idempotent
    assert store.get_bundle("ctx", "model") == committed

    (tmp_path / "tree" / "sub").mkdir(parents=True)
    (tmp_path / "tree" / "a.txt").write_bytes(b"A")
    (tmp_path / "tree" / "sub" / "b.json").write_bytes(b"{}")
    with store.new_bundle("ctx", "tree") as writer:
        entries = writer.add_path(tmp_path / "tree", "data")
        writer.add_path(tmp_path / "tree" / "a.txt")
        tree = writer.finish(commit=True)
    assert [e.path for e in entries] == ["data/a.txt", "data/sub/b.json"]
    assert tree.file("data/sub/b.json").media_type == "application/json"
    assert tree.file("a.txt").media_type == "text/plain"
    assert [b.name for b in store.list_bundles("ctx")] == ["tree", "model"]  # newest first
    assert store.get_context("ctx").bundle_count == 2


def test_latest_resolution_and_filters(store: BundleStore) -> None:
    v1 = add(store, "model", {"f": b"1"}, commit=True, tags={"stage": "prod", "team": "a"})
    v2 = add(store, "model", {"f": b"2"}, commit=True, tags={"stage": "dev", "team": "a"})
    v3 = add(store, "model", {"f": b"3"}, tags={"stage": "dev"})  # uncommitted
    other = add(store, "other", {"f": b"o"})
    # a name means the latest committed version when there is one, else the latest
    assert store.get_bundle("ctx", "model").uuid == v2.uuid
    assert store.get_bundle("ctx", "other").uuid == other.uuid
    assert [b.uuid for b in store.list_bundles("ctx")] == [other.uuid, v3.uuid, v2.uuid, v1.uuid]
    assert [b.uuid for b in store.list_bundles("ctx", bundle_name="model")] == [v3.uuid, v2.uuid, v1.uuid]
    assert [b.uuid for b in store.list_bundles("ctx", committed_only=True)] == [v2.uuid, v1.uuid]
    assert [b.uuid for b in store.list_bundles("ctx", tags={"stage": "dev"})] == [v3.uuid, v2.uuid]
    assert [b.uuid for b in store.list_bundles("ctx", tags={"stage": "dev", "team": "a"})] == [v2.uuid]
    assert [b.uuid for b in store.list_bundles("ctx", latest_only=True)] == [other.uuid, v2.uuid]
    assert [b.uuid for b in store.list_bundles("ctx", latest_only=True, tags={"stage": "prod"})] == [v1.uuid]
    # commit by name takes the newest version
    assert store.commit("ctx", "model").uuid == v3.uuid
    assert store.get_bundle("ctx", "model").uuid == v3.uuid
    with pytest.raises(NotFound, match="'nope'"):
        store.get_bundle("ctx", "nope")
    with pytest.raises(InvalidArgument) as caught:
        store.get_bundle("ctx", "bad name!")
    assert caught.value.field == "ref"


def test_reopen_keeps_bundles_and_order(tmp_path: Path) -> None:
    with BundleStore(tmp_path / "home", None) as store:
        store.create_context("ctx")
        uuids = [add(store, "m", {"f": bytes([i])}, commit=i % 2 == 0).uuid for i in range(5)]
    with BundleStore(tmp_path / "home", None) as store:
        assert [b.uuid for b in store.list_bundles("ctx")] == list(reversed(uuids))
        later = add(store, "m", {"f": b"new"})
        assert store.list_bundles("ctx")[0].uuid == later.uuid


def test_identical_blobs_are_stored_once(store: BundleStore) -> None:
    a = add(store, "a", {"x.bin": b"same bytes", "y.bin": b"same bytes", "z.bin": b"other"})
    b = add(store, "b", {"copy.bin": b"same bytes"})
    assert a.files[0].sha256 == a.files[1].sha256 == b.files[0].sha256
    assert blob_count(store) == 2
    assert read(store, b.uuid, "copy.bin") == b"same bytes"


def test_content_hash_depends_on_content_only(store: BundleStore) -> None:
    one = add(store, "one", {"a": b"1", "b": b"2"}, values={"k": 1}, tags={"t": "x"})
    two = add(store, "two", {"b": b"2", "a": b"1"}, values={"k": 1}, tags={"t": "y"})
    three = add(store, "three", {"a": b"1", "b": b"2"}, values={"k": 1.0})
    assert one.content_hash == two.content_hash != three.content_hash


def test_expected_hash_and_size_mismatch_name_the_file(store: BundleStore) -> None:
    with store.new_bundle("ctx", "m") as writer:
        with pytest.raises(InvalidArgument) as caught:
            writer.add_file("w.bin", [b"abc"], expected_sha256="0" * 64)
        assert caught.value.field == "expected_sha256" and "'w.bin'" in str(caught.value)
        assert hashlib.sha256(b"abc").hexdigest() in str(caught.value)
        with pytest.raises(InvalidArgument) as caught:
            writer.add_file("w.bin", [b"abc"], expected_size=2)
        assert caught.value.field == "expected_size" and "'w.bin'" in str(caught.value)
        with pytest.raises(InvalidArgument, match="`path` .ok.bin. repeats"):
            writer.add_file("ok.bin", [b"abc"], expected_sha256=hashlib.sha256(b"abc").hexdigest(), expected_size=3)
            writer.add_file("ok.bin", [b"abc"])
        bundle = writer.finish()
    assert [f.path for f in bundle.files] == ["ok.bin"]  # the failed file left nothing
    assert not any((store.home / "contexts" / "ctx" / "staging").iterdir())


def test_validation_errors_name_the_field(store: BundleStore, tmp_path: Path) -> None:
    cases = [
        ("context_id", lambda: store.create_context("Bad_Id")),
        ("remote_url", lambda: store.create_context("ok", "http://bucket")),
        ("bundle_name", lambda: store.new_bundle("ctx", "bad name")),
        ("tags[k]", lambda: store.new_bundle("ctx", "m", tags={"k": 1})),
        ("values[v]", lambda: store.new_bundle("ctx", "m", values={"v": object()})),
        ("lineage.input_uuids[0]", lambda: store.new_bundle("ctx", "m", lineage=Lineage(input_uuids=("x",)))),
        ("path", lambda: store.new_bundle("ctx", "m").add_file("../etc/passwd", [b""])),
        ("media_type", lambda: store.new_bundle("ctx", "m").add_file("f", [b""], media_type="onnx")),
        ("grace_s", lambda: store.gc("ctx", grace_s=-5)),
        ("max_depth", lambda: store.lineage("ctx", "x", max_depth=-1)),
        ("part_size", lambda: BundleStore(tmp_path / "other", None, part_size=1024)),
        ("transfer_workers", lambda: BundleStore(tmp_path / "other", None, transfer_workers=0)),
    ]
    for field, call in cases:
        with pytest.raises(InvalidArgument) as caught:
            call()
        assert caught.value.field == field, (field, str(caught.value))
        assert f"`{field}`" in str(caught.value) and "but got" in str(caught.value), str(caught.value)


def test_preconditions(store: BundleStore) -> None:
    bundle = add(store, "m", {"f": b"x"})
    with pytest.raises(FailedPrecondition, match="no remote"):
        store.push("ctx")
    with pytest.raises(FailedPrecondition, match="no remote"):
        store.pull("ctx")
    with pytest.raises(NotFound, match="'missing.txt'"):
        store.open_file("ctx", bundle.uuid, "missing.txt")
    with pytest.raises(NotFound):
        store.list_bundles("nope")


# -- read verification ----------------------------------------------------------------------------------


def test_open_file_streams_and_detects_local_corruption(store: BundleStore) -> None:
    data = os.urandom(3 * 1024 * 1024 + 5)
    bundle = add(store, "m", {"big.bin": data})
    chunks = list(store.open_file("ctx", "m", "big.bin", chunk_size=1024 * 1024))
    assert len(chunks) == 4 and b"".join(chunks) == data

    blob = ContextDir(store.home / "contexts" / "ctx").blob_path(bundle.files[0].sha256)
    corrupted = bytearray(data)
    corrupted[-1] ^= 0xFF
    blob.write_bytes(bytes(corrupted))
    received = []
    with pytest.raises(DataLoss) as caught:
        for chunk in store.open_file("ctx", "m", "big.bin", chunk_size=1024 * 1024):
            received.append(chunk)
    assert len(received) == 3  # the last chunk is held back until the hash is checked
    assert bundle.files[0].sha256 in str(caught.value) and "'big.bin'" in str(caught.value)
    blob.unlink()
    with pytest.raises(DataLoss, match="missing"):
        store.open_file("ctx", "m", "big.bin")


# -- abort and crash recovery ---------------------------------------------------------------------------


def test_abort_leaves_nothing(store: BundleStore) -> None:
    class Broken(Exception):
        pass

    def stream():
        yield b"partial"
        raise Broken

    with pytest.raises(Broken), store.new_bundle("ctx", "m") as writer:
        writer.add_file("ok.bin", [b"fine"])
        writer.add_file("broken.bin", stream())
    writer.abort()  # idempotent
    with pytest.raises(FailedPrecondition, match="aborted"):
        writer.add_file("late.bin", [b"x"])
    assert store.list_bundles("ctx") == []
    assert blob_count(store) == 0
    assert not any((store.home / "contexts" / "ctx" / "staging").iterdir())

    with store.new_bundle("ctx", "m") as writer:  # leaving the block without finish() aborts too
        writer.add_file("f", [b"x"])
    assert store.list_bundles("ctx") == [] and blob_count(store) == 0


def test_killed_add_leaves_no_bundle_and_is_cleaned_on_open(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with BundleStore(home, None) as store:
        store.create_context("ctx")
    child = subprocess.run(
        [sys.executable, str(HERE / "core_child.py"), "add", str(home), "ctx", "20"],
        check=False, capture_output=True, text=True, timeout=60,
    )
    assert child.returncode == -9, child.stdout + child.stderr  # SIGKILLed mid-add
    staging = home / "contexts" / "ctx" / "staging"
    leftovers = [p for p in staging.rglob("*") if p.is_file()]
    assert len(leftovers) == 2  # the finished file and the half-written one
    # leftovers of other crash windows: a temp manifest and a temp download
    (home / "contexts" / "ctx" / "bundles" / ".x.json.abc.tmp").write_bytes(b"{")
    (home / "contexts" / "ctx" / "tmp" / ".dl.tmp").write_bytes(b"partial")
    with BundleStore(home, None) as store:
        assert store.list_bundles("ctx") == []
        assert list(staging.iterdir()) == []
        assert list((home / "contexts" / "ctx" / "tmp").iterdir()) == []
        assert list((home / "contexts" / "ctx" / "bundles").iterdir()) == []
        assert add(store, "after", {"f": b"ok"}).localized  # the store works on


def test_crash_between_blobs_and_manifest_leaves_only_collectable_blobs(tmp_path: Path, monkeypatch) -> None:
    home = tmp_path / "home"
    with BundleStore(home, None) as store:
        store.create_context("ctx")
        writer = store.new_bundle("ctx", "m")
        writer.add_file("f", [b"orphan"])
        from opml_bundle_store.core import context as context_module  # manifests are written there

        def crash(*args, **kwargs):
            raise OSError("disk died while writing the manifest")

        monkeypatch.setattr(context_module, "atomic_write", crash)
        with pytest.raises(OSError, match="disk died"):
            writer.finish()
        monkeypatch.undo()
        assert store.list_bundles("ctx") == []
        assert blob_count(store) == 1  # the blob moved in, no manifest names it
        assert store.gc("ctx", grace_s=0).blobs_removed == 1


# -- lineage ----------------------------------------------------------------------------------------------


def test_lineage_both_ways_and_depth(store: BundleStore) -> None:
    raw = add(store, "raw", {"f": b"r"}, commit=True)
    features = add(store, "features", {"f": b"f"}, lineage=Lineage(input_uuids=(raw.uuid,)))
    labels = add(store, "labels", {"f": b"l"})
    missing = "11111111-2222-3333-4444-555555555555"
    model = add(store, "model", {"f": b"m"}, lineage=Lineage(input_uuids=(features.uuid, labels.uuid, missing)))
    report = add(store, "report", {"f": b"p"}, lineage=Lineage(input_uuids=(model.uuid,)))
    audit = add(store, "audit", {"f": b"a"}, lineage=Lineage(input_uuids=(raw.uuid,)))

    up = store.lineage("ctx", model.uuid, downstream=False)
    assert {b.name for b in up.bundles} == {"model", "features", "labels", "raw"}
    assert set(up.edges) == {(features.uuid, model.uuid), (labels.uuid, model.uuid), (missing, model.uuid),
                             (raw.uuid, features.uuid)}
    down = store.lineage("ctx", "raw", upstream=False)
    assert {b.name for b in down.bundles} == {"raw", "features", "audit", "model", "report"}
    assert (model.uuid, report.uuid) in down.edges and (raw.uuid, audit.uuid) in down.edges
    both = store.lineage("ctx", "features", max_depth=1)
    assert {b.name for b in both.bundles} == {"features", "raw", "model"}
    assert set(both.edges) == {(raw.uuid, features.uuid), (features.uuid, model.uuid)}
    assert store.lineage("ctx", "features", max_depth=0).bundles[0].uuid == features.uuid
    assert len(store.lineage("ctx", "features", max_depth=0).bundles) == 1


# -- delete and gc ----------------------------------------------------------------------------------------


def test_delete_and_gc_respects_grace(store: BundleStore) -> None:
    keep = add(store, "keep", {"shared": b"shared", "own": b"keep"})
    drop = add(store, "drop", {"shared": b"shared", "gone": b"drop-only-1", "gone2": b"drop-only-2"})
    assert store.delete_bundle("ctx", drop.uuid) == [drop.uuid]
    with pytest.raises(NotFound):
        store.get_bundle("ctx", drop.uuid)
    assert blob_count(store) == 4

    young = store.gc("ctx")  # default grace: an hour; the unreferenced blobs are seconds old
    assert (young.blobs_removed, young.blobs_kept) == (0, 4)

    old = time.time() - 7200
    for _, path, _ in ContextDir(store.home / "contexts" / "ctx").iter_blobs():
        os.utime(path, (old, old))
    dry = store.gc("ctx", dry_run=True)
    assert (dry.blobs_removed, dry.bytes_freed, dry.blobs_kept) == (2, 22, 2)
    assert blob_count(store) == 4
    done = store.gc("ctx")
    assert (done.blobs_removed, done.bytes_freed, done.blobs_kept) == (2, 22, 2)
    assert blob_count(store) == 2
    assert read(store, keep.uuid, "shared") == b"shared" and read(store, keep.uuid, "own") == b"keep"


def test_re_adding_an_old_unreferenced_blob_protects_it_from_gc(store: BundleStore) -> None:
    first = add(store, "a", {"f": b"content"})
    store.delete_bundle("ctx", first.uuid)
    old = time.time() - 7200
    for _, path, _ in ContextDir(store.home / "contexts" / "ctx").iter_blobs():
        os.utime(path, (old, old))
    with store.new_bundle("ctx", "b") as writer:
        writer.add_file("f", [b"content"])
        store.gc("ctx")  # runs while the add is in flight: the staged copy is not in objects/
        again = writer.finish()
    assert store.gc("ctx").blobs_removed == 0
    assert read(store, again.uuid, "f") == b"content"


# -- threads ----------------------------------------------------------------------------------------------


def test_concurrent_adds_and_reads(store: BundleStore) -> None:
    errors: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            for index in range(10):
                bundle = add(store, f"w{worker}", {"shared": b"same for all", "own": f"{worker}-{index}".encode()},
                             commit=index % 2 == 0)
                assert read(store, bundle.uuid, "own") == f"{worker}-{index}".encode()
                store.list_bundles("ctx", latest_only=True)
                store.get_bundle("ctx", f"w{worker}")
        except BaseException as exc:  # noqa: BLE001 - collected, asserted empty
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    bundles = store.list_bundles("ctx")
    assert len(bundles) == 80 and len({b.create_time for b in bundles}) == 80
    assert blob_count(store) == 81


# -- transfer internals -------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_ranged_download_hashes_in_order_whatever_order_chunks_land(tmp_path: Path, seed: int) -> None:
    """Ranges download in parallel (each front to back, as one range task does) and land in any
    interleaving; the running sha256 must still be that of the whole blob, with every byte hashed
    by the time the last range task returns."""
    import random

    from opml_bundle_store.core.transfer import BlobRef, _RangedBlob

    data = random.Random(seed).randbytes(10 * 1024 * 1024 + 12345)
    item = _RangedBlob(BlobRef(hashlib.sha256(data).hexdigest(), len(data), "b", "p"), tmp_path / "blob", 1 << 20)
    ranges = list(range(item.count))
    random.Random(seed).shuffle(ranges)
    lock = threading.Lock()

    def range_task(rng: random.Random) -> None:
        while True:
            with lock:
                if not ranges:
                    return
                index = ranges.pop()
            start, length = item.range_of(index)
            for offset in range(start, start + length, 300_000):
                view = memoryview(data)[offset: min(offset + 300_000, start + length)]
                os.pwrite(item.fd, view, offset)
                item.landed(index, offset, view)
                time.sleep(rng.random() / 2000)

    threads = [threading.Thread(target=range_task, args=(random.Random(seed * 10 + n),)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert item.hashed == len(data)
    assert item.hasher.hexdigest() == hashlib.sha256(data).hexdigest()
    item.close()


def test_an_add_repeated_with_its_idempotency_key_returns_the_first_bundle(tmp_path: Path) -> None:
    with BundleStore(tmp_path / "home", None) as store:
        store.create_context("ctx")
        first = add(store, "model", {"m.onnx": b"one"}, idempotency_key="job-1")
        again = add(store, "model", {"m.onnx": b"one"}, commit=True, idempotency_key="job-1")
        for changed in ({"files": {"m.onnx": b"other bytes"}}, {"files": {"m.onnx": b"one"}, "values": {"n": 1}},
                        {"files": {"m.onnx": b"one"}, "tags": {"t": "x"}}):
            with pytest.raises(AlreadyExists, match=rf"'job-1' of bundle 'model' .* content differs.*{first.uuid}"):
                add(store, "model", idempotency_key="job-1", **changed)
        other = add(store, "model", {"m.onnx": b"one"}, idempotency_key="job-2")
        unkeyed = [add(store, "model", {"m.onnx": b"one"}) for _ in range(2)]
        assert again.uuid == first.uuid and again.committed and not first.committed  # the retry's commit is made
        assert read(store, first.uuid, "m.onnx") == b"one"  # nothing of the refused adds is kept
        assert len({first.uuid, other.uuid, *(b.uuid for b in unkeyed)}) == 4
        assert len(store.list_bundles("ctx", bundle_name="model")) == 4
    with BundleStore(tmp_path / "home", None) as reopened:  # the key is in the manifest
        assert add(reopened, "model", {"m.onnx": b"one"}, idempotency_key="job-2").uuid == other.uuid
        with pytest.raises(AlreadyExists, match="'job-2'"):
            add(reopened, "model", {"m.onnx": b"x"}, idempotency_key="job-2")
        with pytest.raises(InvalidArgument, match="idempotency_key"):
            reopened.new_bundle("ctx", "model", idempotency_key="x" * 129)
