"""Manifests from a remote are verified against their signature: a well-formed manifest that anyone
holding the bucket's credentials writes (a canonical uuid, a right content hash, ``serve=true``) does
not become a version.

The forgeries are written to the session's real S3 with the minio client, as such a writer would;
the pushes, pulls and the service are the real code.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import stat
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from minio import Minio
from minio.commonconfig import CopySource
from pydantic import ValidationError

from opml_bundle_store.core import BundleStore, FileEntry, compute_content_hash
from opml_bundle_store.core.layout import ContextDir
from opml_bundle_store.core.manifest import Bundle, RejectedManifest
from opml_bundle_store.core.remote import MANIFEST_SIGNATURE_HEADER, S3Remote
from opml_bundle_store.core.signing import ManifestKeys
from opml_bundle_store.core.sync import MAX_MANIFEST_BYTES
from opml_bundle_store.settings import BundleStoreSettings
from opml_bundle_store_contract.client import BundleStoreClient
from opml_common.config import PlatformSettings
from opml_common.errors import FailedPrecondition, NotFound
from opml_common.storage import s3_client
from opml_devstack.testing.services import TOKENS

MIB = 1024 * 1024
OLD_KEY, NEW_KEY, OTHER_KEY = "o" * 64, "n" * 64, "x" * 64
KEYS = ManifestKeys([OLD_KEY])
SMALL = {"part_size": 5 * MIB, "multipart_threshold": 5 * MIB, "range_size": 4 * MIB, "transfer_workers": 4}
EVIL = b"evil weights"
EVIL_SHA = hashlib.sha256(EVIL).hexdigest()


@pytest.fixture
def s3(platform_settings: PlatformSettings) -> Minio:
    return s3_client(platform_settings)


@pytest.fixture
def stores(tmp_path: Path, s3: Minio, remote_url: str) -> Iterator[tuple[BundleStore, BundleStore, list]]:
    """Two stores (two homes) with the same keys on one remote; what ``b`` refuses is in the list."""
    rejected: list[RejectedManifest] = []
    with BundleStore(tmp_path / "a", s3, manifest_keys=KEYS, **SMALL) as a, \
            BundleStore(tmp_path / "b", s3, manifest_keys=KEYS, on_rejected_manifest=rejected.append, **SMALL) as b:
        a.create_context("ctx", remote_url)
        b.create_context("ctx", remote_url)
        yield a, b, rejected


def add(store: BundleStore, name: str, data: bytes, **kwargs) -> Bundle:
    with store.new_bundle("ctx", name, **kwargs) as writer:
        writer.add_file("w.bin", [data])
        return writer.finish(commit=True)


def forge(s3: Minio, remote: S3Remote, real: Bundle) -> tuple[str, str, bytes]:
    """A well-formed newer version of ``real``'s name serving the forger's weights: a canonical uuid,
    a right content hash, ``serve=true``, its blob in place. Returns its key, uuid and bytes (not yet written)."""
    s3.put_object(remote.bucket, remote.blob_key(EVIL_SHA), io.BytesIO(EVIL), len(EVIL))
    forged_uuid = str(uuid.uuid4())
    files = [FileEntry("w.bin", EVIL_SHA, len(EVIL))]
    doc = {**real.to_manifest(local_state=False), "uuid": forged_uuid, "tags": {"serve": "true"},
           "files": [{"path": "w.bin", "sha256": EVIL_SHA, "size": len(EVIL), "media_type": "application/octet-stream"}],
           "content_hash": compute_content_hash(files, real.values),
           "create_time": (real.create_time + timedelta(days=1)).isoformat()}
    return remote.manifest_key(real.name, forged_uuid), forged_uuid, json.dumps(doc).encode()


def put(s3: Minio, remote: S3Remote, key: str, data: bytes, signature: str | None = None) -> None:
    """Write ``data`` under ``key`` as anyone with the bucket's credentials can, with the signature given."""
    metadata = {MANIFEST_SIGNATURE_HEADER: signature} if signature is not None else None
    s3.put_object(remote.bucket, key, io.BytesIO(data), len(data), metadata=metadata)


def reasons(rejected: list[RejectedManifest]) -> dict[str, str]:
    return {r.key: r.reason for r in rejected}


@pytest.mark.parametrize("localize", [False, True])
def test_a_forged_well_formed_manifest_is_refused_and_never_becomes_the_newest_version(
        stores, s3: Minio, remote_url: str, localize: bool) -> None:
    """Before, this manifest passed every check (canonical uuid, the add's rules, its key, its content
    hash) and became what `model` resolved to, serving the forger's weights."""
    a, b, rejected = stores
    real = add(a, "model", b"real weights", tags={"serve": "true"})
    a.push("ctx")
    remote = S3Remote(s3, remote_url)
    key, forged_uuid, data = forge(s3, remote, real)
    put(s3, remote, key, data)

    assert [p.uuid for p in b.pull("ctx", localize=localize)] == [real.uuid]  # the rest of the pull goes on
    assert reasons(rejected) == {key: "signature"}
    assert key in rejected[0].message and "signature missing" in rejected[0].message
    assert b.get_bundle("ctx", "model").uuid == real.uuid
    assert [x.uuid for x in b.list_bundles("ctx", bundle_name="model", latest_only=True)] == [real.uuid]
    with pytest.raises(NotFound):
        b.get_bundle("ctx", forged_uuid)
    assert not ContextDir(b.home / "contexts" / "ctx").blob_path(EVIL_SHA).exists()  # its blob was never fetched


def test_a_manifest_signed_with_another_key_is_refused(stores, s3: Minio, remote_url: str) -> None:
    a, b, rejected = stores
    real = add(a, "model", b"real weights")
    a.push("ctx")
    remote = S3Remote(s3, remote_url)
    key, forged_uuid, data = forge(s3, remote, real)
    put(s3, remote, key, data, ManifestKeys([OTHER_KEY]).sign("model", forged_uuid, data))

    assert [p.uuid for p in b.pull("ctx")] == [real.uuid]
    assert reasons(rejected) == {key: "signature"} and "signature invalid" in rejected[0].message
    assert b.get_bundle("ctx", "model").uuid == real.uuid


def test_a_manifest_changed_after_it_was_signed_is_refused(stores, s3: Minio, remote_url: str) -> None:
    a, b, rejected = stores
    real = add(a, "model", b"real weights", tags={"serve": "false"})
    a.push("ctx")
    remote = S3Remote(s3, remote_url)
    key = remote.manifest_key("model", real.uuid)
    signed = remote.get_manifest(key, max_bytes=MAX_MANIFEST_BYTES)
    assert signed.signature is not None and KEYS.verify("model", real.uuid, signed.data, signed.signature)
    changed = signed.data.replace(b'"serve": "false"', b'"serve": "fals3"')  # one byte, still well-formed
    assert len(changed) == len(signed.data) and sum(x != y for x, y in zip(changed, signed.data, strict=True)) == 1
    put(s3, remote, key, changed, signed.signature)

    assert b.pull("ctx") == []
    assert reasons(rejected) == {key: "signature"} and "signature invalid" in rejected[0].message
    assert b.list_bundles("ctx") == []


def test_the_signature_covers_the_name_and_uuid(stores, s3: Minio, remote_url: str) -> None:
    """A signed manifest copied (S3 CopyObject, metadata and all) under another name or uuid is refused."""
    a, b, rejected = stores
    real = add(a, "model", b"real weights")
    a.push("ctx")
    remote = S3Remote(s3, remote_url)
    source = CopySource(remote.bucket, remote.manifest_key("model", real.uuid))
    copies = [remote.manifest_key("serving-model", real.uuid), remote.manifest_key("model", str(uuid.uuid4()))]
    for copy in copies:
        s3.copy_object(remote.bucket, copy, source)
        assert remote.get_manifest(copy, max_bytes=MAX_MANIFEST_BYTES).signature is not None  # copied with it

    assert [p.uuid for p in b.pull("ctx")] == [real.uuid]  # the original still pulls
    assert reasons(rejected) == {copy: "signature" for copy in copies}
    with pytest.raises(NotFound):
        b.get_bundle("ctx", "serving-model")


def test_keys_rotate_the_first_signs_and_every_one_verifies(tmp_path: Path, s3: Minio, remote_url: str) -> None:
    rejected: list[RejectedManifest] = []
    rotated = ManifestKeys([NEW_KEY, OLD_KEY])
    with BundleStore(tmp_path / "old", s3, manifest_keys=KEYS, on_rejected_manifest=rejected.append) as old, \
            BundleStore(tmp_path / "new", s3, manifest_keys=rotated) as new, \
            BundleStore(tmp_path / "newest", s3, manifest_keys=ManifestKeys([NEW_KEY])) as newest:
        for store in (old, new, newest):
            store.create_context("ctx", remote_url)
        before = add(old, "model", b"v1")
        old.push("ctx")
        assert [p.uuid for p in new.pull("ctx", localize=True)] == [before.uuid]  # signed with the old key
        after = add(new, "model", b"v2")
        new.push("ctx")
        assert [p.uuid for p in newest.pull("ctx")] == [after.uuid]  # the old key's manifest is refused...
        new.push("ctx", before.uuid)  # ...until a store holding the new key pushes it again: signed anew
        assert [p.uuid for p in newest.pull("ctx")] == [before.uuid]
        old.pull("ctx")
        assert [r.reason for r in rejected] == ["signature"]  # a store that holds only the old key refuses v2


def test_a_manifest_pushed_before_signatures_is_refused_until_pushed_again(stores, s3: Minio,
                                                                           remote_url: str) -> None:
    a, b, rejected = stores
    real = add(a, "model", b"real weights")
    a.push("ctx")
    remote = S3Remote(s3, remote_url)
    key = remote.manifest_key("model", real.uuid)
    put(s3, remote, key, remote.get_manifest(key, max_bytes=MAX_MANIFEST_BYTES).data)  # as it was: unsigned

    assert b.pull("ctx") == []
    assert reasons(rejected) == {key: "signature"}
    assert "signature missing" in rejected[0].message and "push it again" in rejected[0].message
    assert [p.uuid for p in a.push("ctx", real.uuid)] == [real.uuid]  # the remedy: re-pushed, now signed
    assert [p.uuid for p in b.pull("ctx", localize=True)] == [real.uuid]
    assert b"".join(b.open_file("ctx", "model", "w.bin")) == b"real weights"


def test_a_store_given_no_keys_keeps_its_own_in_its_home(tmp_path: Path, s3: Minio, remote_url: str) -> None:
    home = tmp_path / "home"
    with BundleStore(home, s3, **SMALL) as store:
        store.create_context("ctx", remote_url)
        real = add(store, "model", b"real weights")
        store.push("ctx")
    key_file = home / "manifest.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    kept = key_file.read_bytes()
    with BundleStore(home, s3, **SMALL) as store:  # the same key after a restart
        assert key_file.read_bytes() == kept
        store.delete_bundle("ctx", real.uuid)
        assert [p.uuid for p in store.pull("ctx")] == [real.uuid]
    with BundleStore(tmp_path / "other", s3, manifest_keys=ManifestKeys.from_file(key_file), **SMALL) as other:
        other.create_context("ctx", remote_url)  # a store given that key (a copy of the file) verifies it too
        assert [p.uuid for p in other.pull("ctx")] == [real.uuid]
    key_file.write_text("short\n")
    with pytest.raises(FailedPrecondition, match="manifest.key holds no valid manifest key") as caught:
        BundleStore(home, s3, **SMALL)
    assert "short" not in caught.value.message


# -- settings -------------------------------------------------------------------------------------------------


def test_the_keys_come_from_a_file_or_the_environment_and_prod_needs_them(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OPML_BUNDLE_STORE_MANIFEST_KEY_FILE", "OPML_BUNDLE_STORE_MANIFEST_KEYS"):
        monkeypatch.delenv(name, raising=False)
    assert BundleStoreSettings().manifest_signing_keys("dev") is None  # the store keeps its own
    with pytest.raises(ValueError, match="OPML_BUNDLE_STORE_MANIFEST_KEY_FILE .or OPML_BUNDLE_STORE_MANIFEST_KEYS. "
                                         "must be set when OPML_ENV=prod"):
        BundleStoreSettings().manifest_signing_keys("prod")

    key_file = tmp_path / "keys"
    key_file.write_text(f"{NEW_KEY}\n{OLD_KEY}\n")
    from_file = BundleStoreSettings(manifest_key_file=key_file).manifest_signing_keys("prod")
    from_env = BundleStoreSettings(manifest_keys=f"{NEW_KEY},{OLD_KEY}").manifest_signing_keys("prod")
    for keys in (from_file, from_env):
        assert keys is not None
        signature = keys.sign("model", "u", b"{}")
        assert ManifestKeys([NEW_KEY]).verify("model", "u", b"{}", signature)  # the first signs
        assert keys.verify("model", "u", b"{}", KEYS.sign("model", "u", b"{}"))  # every one verifies
        assert NEW_KEY not in repr(keys)

    with pytest.raises(ValueError, match=r"OPML_BUNDLE_STORE_MANIFEST_KEY_FILE: .*/missing cannot be used"):
        BundleStoreSettings(manifest_key_file=tmp_path / "missing").manifest_signing_keys("prod")
    key_file.write_text(f"{NEW_KEY}\nshort-secret\n")
    with pytest.raises(ValueError, match="manifest key 2 must be at least 32 characters") as caught:
        BundleStoreSettings(manifest_key_file=key_file).manifest_signing_keys("prod")
    assert "short-secret" not in str(caught.value) and NEW_KEY not in str(caught.value)
    with pytest.raises(ValidationError, match="manifest key 1 must be") as refused:
        BundleStoreSettings(manifest_keys="short-secret")
    assert "short-secret" not in str(refused.value)
    with pytest.raises(ValidationError, match="not both"):
        BundleStoreSettings(manifest_keys=NEW_KEY, manifest_key_file=tmp_path / "keys")


def test_the_service_refuses_to_start_in_prod_without_manifest_keys(start_service) -> None:
    env = start_service.env("bundle-store", extra_env={
        "OPML_ENV": "prod", "OPML_S3_SECRET_KEY": "not-the-dev-secret", "OPML_KAFKA_ALLOW_PLAINTEXT": "true"})
    env = {k: v for k, v in {**os.environ, **env}.items() if not k.startswith("OPML_BUNDLE_STORE_MANIFEST_KEY")}
    child = subprocess.run([sys.executable, "-m", "opml_bundle_store"], env=env, check=False, capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == 1, child.stdout + child.stderr
    assert ("bundle-store: refusing to start: OPML_BUNDLE_STORE_MANIFEST_KEY_FILE (or OPML_BUNDLE_STORE_MANIFEST_KEYS)"
            " must be set when OPML_ENV=prod") in child.stderr


# -- through the service --------------------------------------------------------------------------------------


def _rejected_metric(service) -> dict[str, float]:
    port = service.env["OPML_BUNDLE_STORE_METRICS_PORT"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {m[0]: float(m[1]) for m in
            re.findall(r'opml_bundle_store_remote_manifests_rejected_total\{reason="(\w+)"\} (\S+)', text)}


def test_the_service_verifies_with_its_key_file_refuses_a_forgery_and_counts_it(
        start_service, tmp_path: Path, s3: Minio, remote_url: str) -> None:
    key_file = tmp_path / "manifest-keys"
    key_file.write_text(f"{NEW_KEY}\n{OLD_KEY}\n")
    key_file.chmod(0o600)
    service = start_service("bundle-store", extra_env={"OPML_BUNDLE_STORE_MANIFEST_KEY_FILE": str(key_file)})
    with BundleStore(tmp_path / "plant-a", s3, manifest_keys=KEYS, **SMALL) as plant:  # holds the old key only
        plant.create_context("ctx", remote_url)
        real = add(plant, "model", b"real weights", tags={"serve": "true"})
        plant.push("ctx")
    remote = S3Remote(s3, remote_url)
    key, forged_uuid, data = forge(s3, remote, real)
    put(s3, remote, key, data)
    assert _rejected_metric(service)["signature"] == 0

    with BundleStoreClient(service.target, token=TOKENS["admin"]) as admin:
        admin.create_context("plant-b", remote_url)
        final = list(admin.pull("plant-b", localize=True))[-1]
        assert final.done and [x.uuid for x in final.bundles] == [real.uuid]
        assert admin.get_bundle("plant-b", "model").uuid == real.uuid
        with pytest.raises(NotFound):
            admin.get_bundle("plant-b", forged_uuid)
        added = admin.add("plant-b", "report", {"r": b"1"}, commit=True)
        list(admin.push("plant-b"))
    assert _rejected_metric(service)["signature"] == 1
    log = service.log_path.read_text()
    assert key in log and "signature missing" in log
    assert NEW_KEY not in log and OLD_KEY not in log
    pushed = remote.get_manifest(remote.manifest_key("report", added.uuid), max_bytes=MAX_MANIFEST_BYTES)
    assert ManifestKeys([NEW_KEY]).verify("report", added.uuid, pushed.data, pushed.signature or "")  # signs: first
