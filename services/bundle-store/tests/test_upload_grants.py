"""Upload grants: the token's signature, expiry and format (unit), and what its holder may do against a
real bundle-store process (auth on, and in dev with auth off), two replicas sharing the key included."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from opml.bundles.v1 import bundles_pb2 as pb

from opml_bundle_store.core import grants
from opml_bundle_store.core.grants import GrantKeys
from opml_bundle_store.settings import BundleStoreSettings
from opml_bundle_store_contract.client import BundleStoreClient
from opml_common.errors import InvalidArgument, NotFound, PermissionDenied, Unauthenticated
from opml_devstack.process import ServiceProcess
from opml_devstack.testing.services import TOKENS

KEYS = GrantKeys(["g" * 64])
NOW = 1_700_000_000.0


def _issue(**changes) -> str:
    fields = {"context_id": "automl", "bundle_name": "exp-trial-1", "max_bytes": 1000, "ttl_s": 60, "now": NOW,
              **changes}
    return grants.issue(KEYS, **fields)[0]


def test_a_grant_verifies_with_its_fields_until_it_expires() -> None:
    token, issued = grants.issue(KEYS, context_id="automl", bundle_name="exp-trial-1", max_bytes=1000, ttl_s=60,
                                 now=NOW)
    assert token.startswith(grants.TOKEN_PREFIX) and issued.grant_id not in ("", token)
    assert grants.verify(KEYS, token, now=NOW + 59) == issued
    assert (issued.context_id, issued.bundle_name, issued.max_bytes, issued.expires_at) == (
        "automl", "exp-trial-1", 1000, NOW + 60)
    with pytest.raises(Unauthenticated, match=f"upload grant {issued.grant_id} expired") as caught:
        grants.verify(KEYS, token, now=NOW + 60)
    assert token not in caught.value.message


def test_a_token_that_is_no_grant_is_left_to_the_configured_tokens() -> None:
    assert grants.verify(KEYS, "writer-token", now=NOW) is None


def test_a_grant_keeps_verifying_after_its_key_is_rotated_and_not_after_it_is_retired() -> None:
    token = _issue()
    assert grants.verify(GrantKeys(["n" * 64, "g" * 64]), token, now=NOW) is not None
    with pytest.raises(Unauthenticated, match="does not verify"):
        grants.verify(GrantKeys(["n" * 64]), token, now=NOW)


@pytest.mark.parametrize("tamper", ["payload", "signature", "truncated", "oversized"])
def test_a_tampered_grant_is_refused_without_quoting_it(tamper: str) -> None:
    token = _issue()
    payload, signature = token[len(grants.TOKEN_PREFIX):].split(".")
    if tamper == "payload":  # a bigger allowance, the same signature
        fields = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        fields["max"], fields["name"] = 10**12, "other"
        forged = base64.urlsafe_b64encode(json.dumps(fields).encode()).rstrip(b"=").decode()
        token = f"{grants.TOKEN_PREFIX}{forged}.{signature}"
    elif tamper == "signature":
        token = f"{grants.TOKEN_PREFIX}{payload}.{'0' * len(signature)}"
    elif tamper == "truncated":
        token = f"{grants.TOKEN_PREFIX}{payload}"
    else:
        token = f"{grants.TOKEN_PREFIX}{payload}{'A' * grants.MAX_TOKEN_CHARS}.{signature}"
    with pytest.raises(Unauthenticated, match="does not verify") as caught:
        grants.verify(KEYS, token, now=NOW)
    assert payload not in caught.value.message and signature not in caught.value.message


# -- against a real bundle-store --------------------------------------------------------------------------


def _grant(writer: BundleStoreClient, name: str = "exp-trial-1", *, context: str = "automl",
           max_bytes: int = 1000, ttl_s: int = 600) -> str:
    return writer.create_upload_grant(context, name, ttl_s=ttl_s, max_bytes=max_bytes)


def test_a_grant_adds_gets_and_lists_its_bundle_and_nothing_else(bundle_store: ServiceProcess,
                                                                  admin: BundleStoreClient,
                                                                  writer: BundleStoreClient) -> None:
    admin.create_context("automl")
    admin.create_context("other")
    elsewhere = admin.add("automl", "exp-best", {"w.bin": b"secret weights"}, commit=True)
    token = _grant(writer)
    with BundleStoreClient(bundle_store.target, token=token) as holder:
        added = holder.add("automl", "exp-trial-1", {"model.bin": b"w" * 100, "model.yaml": b"name: m\n"},
                           values={"loss": 0.5}, tags={"serve": "true"})
        assert added.lineage.creator.startswith("upload-grant:") and token not in added.lineage.creator
        assert not added.committed  # nothing the platform acts on
        assert holder.get_bundle("automl", "exp-trial-1").uuid == added.uuid
        assert holder.get_bundle("automl", added.uuid).uuid == added.uuid
        assert [b.uuid for b in holder.list_bundles("automl", bundle_name="exp-trial-1")] == [added.uuid]

        denied = {
            "another name": lambda: holder.add("automl", "exp-best", {"m": b"x"}),
            "committing in the add": lambda: holder.add("automl", "exp-trial-1", {"m": b"x"}, commit=True),
            "committing after": lambda: holder.commit("automl", added.uuid),
            "another context": lambda: holder.add("other", "exp-trial-1", {"m": b"x"}),
            "over max_bytes": lambda: holder.add("automl", "exp-trial-1", {"m": b"x" * 1001}),
            "another bundle by name": lambda: holder.get_bundle("automl", "exp-best"),
            "another bundle by uuid": lambda: holder.get_bundle("automl", elsewhere.uuid),
            "a uuid that is not there": lambda: holder.get_bundle("automl", "0" * 32),
            "every name": lambda: holder.list_bundles("automl"),
            "another context's list": lambda: holder.list_bundles("other", bundle_name="exp-trial-1"),
            "reading a file": lambda: list(holder.read_file("automl", added.uuid, "model.bin")),
            "a grant of its own": lambda: holder.create_upload_grant("automl", "x", ttl_s=60, max_bytes=1),
            "listing contexts": lambda: holder.list_contexts(),
            "deleting": lambda: holder.delete("automl", added.uuid),
        }
        messages = {}
        for what, call in denied.items():
            with pytest.raises(PermissionDenied) as caught:
                call()
            messages[what] = caught.value.message
        assert all(token not in message for message in messages.values())
        assert "ReadBundleFile is not allowed with upload grant" in messages["reading a file"]
        assert "allows only AddBundle, GetBundle, ListBundles" in messages["reading a file"]
        assert "allows bundle 'exp-trial-1' in context 'automl' only" in messages["another name"]
        assert "more than the 1000" in messages["over max_bytes"]
        assert "adds uncommitted versions only" in messages["committing in the add"]
    assert [b.bundle_name for b in admin.list_bundles("automl")].count("exp-best") == 1
    assert token not in bundle_store.log_path.read_text()


def test_a_tampered_grant_is_unauthenticated_and_a_bad_request_names_every_field(
        bundle_store: ServiceProcess, admin: BundleStoreClient, writer: BundleStoreClient) -> None:
    admin.create_context("automl")
    token = _grant(writer)
    forged = token[:-4] + ("1111" if token.endswith("0000") else "0000")
    with BundleStoreClient(bundle_store.target, token=forged) as forger, \
            pytest.raises(Unauthenticated, match="does not verify"):
        forger.get_bundle("automl", "exp-trial-1")
    with pytest.raises(InvalidArgument) as caught:
        writer.stub.CreateUploadGrant(pb.CreateUploadGrantRequest(parent="automl", bundle_name="../x",
                                                                  ttl_seconds=0, max_bytes=-1))
    assert {field for field, _ in caught.value.violations} == {"parent", "bundle_name", "ttl_seconds", "max_bytes"}
    with pytest.raises(NotFound):
        _grant(writer, context="nowhere")
    with BundleStoreClient(bundle_store.target, token="unknown") as stranger, pytest.raises(Unauthenticated):
        stranger.create_upload_grant("automl", "x", ttl_s=60, max_bytes=1)


def test_replicas_sharing_the_key_accept_each_others_grants_and_dev_mode_still_restricts_a_holder(
        start_service, tmp_path: Path) -> None:
    key_file = tmp_path / "grant.key"
    key_file.write_text("k" * 64 + "\n")
    shared = {"OPML_BUNDLE_STORE_GRANT_KEY_FILE": str(key_file)}
    issuer = start_service("bundle-store", extra_env=shared)
    dev = start_service("bundle-store", tokens=None, extra_env=shared)  # auth off: everyone else is admin
    with BundleStoreClient(issuer.target, token=TOKENS["admin"]) as admin:
        admin.create_context("automl")
        token = admin.create_upload_grant("automl", "exp-trial-1", ttl_s=600, max_bytes=1000)
    with BundleStoreClient(dev.target) as anyone:
        anyone.create_context("automl")
    with BundleStoreClient(dev.target, token=token) as holder:
        assert holder.add("automl", "exp-trial-1", {"m": b"x"}).bundle_name == "exp-trial-1"
        with pytest.raises(PermissionDenied, match="DeleteBundle is not allowed with upload grant"):
            holder.delete("automl", "exp-trial-1")
        with pytest.raises(PermissionDenied, match="allows bundle 'exp-trial-1'"):
            holder.add("automl", "exp-best", {"m": b"x"})
    with BundleStoreClient(dev.target) as anyone:  # no token in dev: an admin, as before
        assert [b.bundle_name for b in anyone.list_bundles("automl")] == ["exp-trial-1"]


def test_grant_keys_come_from_a_file_or_the_environment_and_prod_needs_them(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OPML_BUNDLE_STORE_GRANT_KEY_FILE", "OPML_BUNDLE_STORE_GRANT_KEYS"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="OPML_BUNDLE_STORE_GRANT_KEY_FILE .or OPML_BUNDLE_STORE_GRANT_KEYS. must "
                                         "be set when OPML_ENV=prod"):
        BundleStoreSettings().upload_grant_keys("prod")
    assert BundleStoreSettings().upload_grant_keys("dev") is None  # the store keeps one in its home
    key_file = tmp_path / "grant.key"
    key_file.write_text("k" * 64 + "\n")
    token = _issue()
    with pytest.raises(Unauthenticated):
        grants.verify(BundleStoreSettings(grant_key_file=key_file).upload_grant_keys("prod"), token, now=NOW)
    assert grants.verify(BundleStoreSettings(grant_keys="g" * 64).upload_grant_keys("prod"), token, now=NOW)
    with pytest.raises(ValueError, match="grant key 1 must be at least 32 characters"):
        BundleStoreSettings(grant_keys="short")
