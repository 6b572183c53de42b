"""`opml bundle` against a running service: Disdat's verbs as a user types them."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from opml_bundle_store_contract.client import BundleStoreClient
from opml_common.errors import Unauthenticated
from opml_devstack.testing.services import TOKENS


@pytest.fixture
def opml(bundle_store, opml_cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Runs `opml ...` in-process against the test service as an admin; fails the test on a non-zero exit."""
    monkeypatch.setenv("OPML_CLI_HOME", str(tmp_path / "cli"))
    monkeypatch.setenv("OPML_BUNDLE_STORE_TARGET", bundle_store.target)
    return functools.partial(opml_cli, token="admin")


def test_disdat_workflow(opml, remote_url: str, tmp_path: Path) -> None:
    model = tmp_path / "model"
    (model / "layers").mkdir(parents=True)
    (model / "layers" / "w.bin").write_bytes(b"\x01" * 5000)
    (model / "config.json").write_text('{"layers": 3}')

    opml("bundle", "context", "create", "plant-a", "--remote", remote_url)
    opml("bundle", "context", "create", "plant-b", "--remote", remote_url)
    assert "switched to plant-a" in opml("bundle", "context", "switch", "plant-a")
    listed = opml("bundle", "context", "ls")
    assert "plant-a" in listed and "plant-b" in listed

    out = opml("bundle", "add", "classifier", str(model), "--value", "accuracy=0.91", "--value", "epochs=3",
               "--tag", "stage=candidate", "--param", "lr=0.01")
    assert "uncommitted" in out
    assert "classifier" in opml("bundle", "ls", "--tag", "stage=candidate")
    assert json.loads(opml("bundle", "ls", "--committed", "--json")) == []
    opml("bundle", "commit", "classifier")
    assert "pushed classifier" in opml("bundle", "push")
    assert "pulled 1 bundles (localized)" in opml("bundle", "-c", "plant-b", "pull", "classifier", "--localize")

    shown = json.loads(opml("bundle", "-c", "plant-b", "cat", "classifier"))
    assert shown["values"]["accuracy"] == {"floatValue": 0.91} and shown["values"]["epochs"] == {"intValue": "3"}
    assert shown["lineage"]["parameters"] == {"lr": "0.01"}
    assert opml("bundle", "-c", "plant-b", "cat", "classifier", "--file", "model/config.json") == '{"layers": 3}'
    opml("bundle", "-c", "plant-b", "get", "classifier", "-o", str(tmp_path / "out"))
    assert (tmp_path / "out" / "model" / "layers" / "w.bin").read_bytes() == b"\x01" * 5000

    uuid = shown["uuid"]
    first = opml("bundle", "add", "scores", "--value", "auc=0.8", "--input", uuid, "--commit", "--idempotency-key", "s1")
    assert opml("bundle", "add", "scores", "--value", "auc=0.8", "--input", uuid, "--commit",
                "--idempotency-key", "s1") == first  # the retry: the same bundle, not another
    assert "scores" in opml("bundle", "lineage", "classifier", "--direction", "down")

    denied = opml("bundle", "rm", "classifier", token="writer", expect_exit=1)
    assert "PERMISSION_DENIED" in denied and "admin" in denied
    assert uuid in opml("bundle", "rm", "classifier")
    assert "NOT_FOUND" in opml("bundle", "cat", uuid, expect_exit=1)
    assert "would remove 0 blobs" in opml("bundle", "gc", "--dry-run")  # the default grace keeps them an hour
    assert "would remove 2 blobs" in opml("bundle", "gc", "--grace", "0", "--dry-run")  # classifier's two files


def test_usage_errors_are_clear(opml) -> None:
    assert "no context" in opml("bundle", "ls", expect_exit=2)
    assert "KEY=VALUE" in opml("bundle", "-c", "x", "add", "b", "--tag", "novalue", expect_exit=2)


def test_a_grant_revoked_with_the_cli_is_refused_from_then_on(opml, bundle_store) -> None:
    """A context of one store (not shared): the revocation is kept in its directory."""
    opml("bundle", "context", "create", "automl")
    with BundleStoreClient(bundle_store.target, token=TOKENS["writer"]) as writer:
        issued = writer.issue_upload_grant("automl", "trial-1", ttl_s=600, max_bytes=1000)
    with BundleStoreClient(bundle_store.target, token=issued.token) as holder:
        holder.add("automl", "trial-1", {"model.onnx": b"accepted"})
        denied = opml("bundle", "-c", "automl", "grant", "revoke", issued.grant_id, token="reader", expect_exit=1)
        assert "PERMISSION_DENIED" in denied and "writer" in denied
        revoked = opml("bundle", "-c", "automl", "grant", "revoke", issued.grant_id, token="writer")
        assert f"revoked upload grant {issued.grant_id} of context automl" in revoked
        with pytest.raises(Unauthenticated, match=f"upload grant {issued.grant_id} was revoked"):
            holder.add("automl", "trial-1", {"model.onnx": b"after"})
        with pytest.raises(Unauthenticated, match="was revoked"):
            holder.get_bundle("automl", "trial-1")
    assert opml("bundle", "-c", "automl", "grant", "revoke", issued.grant_id) == revoked  # again: the same time
    assert "grant_id" in opml("bundle", "-c", "automl", "grant", "revoke", "NOT-AN-ID", expect_exit=1)
