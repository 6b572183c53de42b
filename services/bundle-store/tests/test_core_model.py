"""Unit tests of the core's values: validation rules, the manifest JSON and the content hash."""

from __future__ import annotations

import hashlib
import json
import math
import uuid
from datetime import UTC, datetime

import pytest

from opml_bundle_store.core.manifest import Bundle, FileEntry, Lineage, compute_content_hash
from opml_bundle_store.core.remote_url import parse_remote_url
from opml_bundle_store.core.rules import (
    MAX_LINEAGE_INPUTS,
    validate_bundle_name,
    validate_context_id,
    validate_lineage,
    validate_string_map,
    validate_values,
)
from opml_bundle_store_contract.paths import validate_bundle_path
from opml_common.errors import InvalidArgument

SHA_A = "a" * 64
SHA_B = "b" * 64


def sample_bundle(**changes) -> Bundle:
    fields = {
        "context": "ctx", "name": "model", "uuid": "0b9e6f3c-5a4d-4c1e-9f7a-2d8b1c3e4f5a",
        "tags": {"stage": "prod"},
        "files": (FileEntry("b.onnx", SHA_B, 20, "application/onnx"), FileEntry("a/x.txt", SHA_A, 10)),
        "values": {"acc": 0.93, "epochs": 12, "ok": True, "note": "héllo", "blob": b"\x00\xff", "nan": float("nan")},
        "lineage": Lineage(input_uuids=("11111111-2222-3333-4444-555555555555",), code_version="abc123",
                           parameters={"lr": "0.1"}, creator="alice",
                           start_time=datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC),
                           stop_time=datetime(2024, 1, 2, 4, 4, 5, tzinfo=UTC)),
        "content_hash": "", "committed": True,
        "create_time": datetime(2024, 1, 2, 5, 0, 0, 123456, tzinfo=UTC),
        "commit_time": datetime(2024, 1, 2, 5, 0, 1, tzinfo=UTC),
        "remote_url": "s3://bucket/prefix", "localized": False,
    }
    fields.update(changes)
    if not fields["content_hash"]:
        fields["content_hash"] = compute_content_hash(fields["files"], fields["values"])
    return Bundle(**fields)


# -- validation: each error names the field and shows the value --------------------------------------


@pytest.mark.parametrize("value", ["ok", "a", "a-b-1", "0" * 63])
def test_valid_context_ids(value: str) -> None:
    assert validate_context_id(value) == value


@pytest.mark.parametrize("value", ["", "Upper", "-lead", "a_b", "a" * 64, "a/b", 7])
def test_invalid_context_id_names_field_and_value(value) -> None:
    with pytest.raises(InvalidArgument) as caught:
        validate_context_id(value)
    assert caught.value.field == "context_id"
    assert "`context_id` must match" in str(caught.value)
    assert repr(value) in str(caught.value)


@pytest.mark.parametrize("value", ["Model", "m.v1_final-2", "A" * 128])
def test_valid_bundle_names(value: str) -> None:
    assert validate_bundle_name(value) == value


@pytest.mark.parametrize("value", ["", ".hidden", "a b", "a/b", "A" * 129])
def test_invalid_bundle_name(value: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        validate_bundle_name(value)
    assert caught.value.field == "bundle_name"
    assert repr(value)[:40] in str(caught.value)


@pytest.mark.parametrize("value", ["a", "a/b/c.txt", "weird name/ü.bin", "x..y"])
def test_valid_bundle_paths(value: str) -> None:
    assert validate_bundle_path(value) == value


@pytest.mark.parametrize("value, rule", [
    *((value, "relative '/'-separated path") for value in ("", "/abs", "a//b", "a/", "../x", "a/../b", "./a", "a/.")),
    ("nul\x00", "control characters"), ("line\nbreak", "control characters"), ("cr\r", "control characters"),
    ("del\x7f", "control characters"), ("c1\x85", "control characters"), ("a\\b", "no backslash"),
    ("..\\x", "no backslash"), ("d/" + "x" * 256, "at most 255 bytes"), ("\u00e9" * 128, "at most 255 bytes"),
])
def test_invalid_bundle_paths(value: str, rule: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        validate_bundle_path(value)
    assert caught.value.field == "path"
    assert rule in str(caught.value)


def test_segment_cap_is_255_utf8_bytes() -> None:
    assert validate_bundle_path("x" * 255) and validate_bundle_path("\u00e9" * 127 + "x")


def test_parse_remote_url() -> None:
    assert parse_remote_url("s3://bucket") == ("bucket", "")
    assert parse_remote_url("s3://bucket/") == ("bucket", "")
    assert parse_remote_url("s3://my.bucket-1/a/b/") == ("my.bucket-1", "a/b")


@pytest.mark.parametrize("value", ["http://bucket/x", "s3://", "s3://Bucket/x", "s3://ab/x", "s3://b_x/y",
                                   "s3://bucket/a//b", "s3://bucket/../x", "s3://1.2.3.4/x", None])
def test_invalid_remote_urls(value) -> None:
    with pytest.raises(InvalidArgument) as caught:
        parse_remote_url(value)
    assert caught.value.field == "remote_url"
    assert repr(value)[:30] in str(caught.value) or "bucket" in str(caught.value)


def test_value_validation_names_the_key() -> None:
    with pytest.raises(InvalidArgument) as caught:
        validate_values({"ok": 1, "bad": [1, 2]})
    assert caught.value.field == "values[bad]"
    assert "list" in str(caught.value)
    with pytest.raises(InvalidArgument) as caught:
        validate_values({"big": 2**63})
    assert caught.value.field == "values[big]"
    with pytest.raises(InvalidArgument) as caught:
        validate_string_map({"k": 3}, "tags")
    assert caught.value.field == "tags[k]"
    with pytest.raises(InvalidArgument) as caught:
        validate_string_map({"": "v"}, "tags")
    assert caught.value.field == "tags"


def test_lineage_validation() -> None:
    lineage = validate_lineage(Lineage(input_uuids=("0B9E6F3C-5A4D-4C1E-9F7A-2D8B1C3E4F5A",),
                                       start_time=datetime(2024, 1, 1)))
    assert lineage.input_uuids == ("0b9e6f3c-5a4d-4c1e-9f7a-2d8b1c3e4f5a",)  # canonical form
    assert lineage.start_time.tzinfo is UTC  # naive taken as UTC
    with pytest.raises(InvalidArgument) as caught:
        validate_lineage(Lineage(input_uuids=("ok-not",)))
    assert caught.value.field == "lineage.input_uuids[0]"
    with pytest.raises(InvalidArgument) as caught:
        validate_lineage(Lineage(start_time=datetime(2024, 1, 2), stop_time=datetime(2024, 1, 1)))
    assert caught.value.field == "lineage.stop_time"


def test_lineage_inputs_are_deduplicated_in_order_and_capped() -> None:
    inputs = [str(uuid.UUID(int=n)) for n in range(MAX_LINEAGE_INPUTS - 2)]
    lineage = validate_lineage(Lineage(input_uuids=[*inputs, inputs[0].upper(), inputs[1]]))  # at the cap
    assert lineage.input_uuids == tuple(inputs)  # the first of each kept, in order
    with pytest.raises(InvalidArgument, match=f"at most {MAX_LINEAGE_INPUTS} bundles, but got {len(inputs) * 2}") \
            as caught:
        validate_lineage(Lineage(input_uuids=inputs * 2))
    assert caught.value.field == "lineage.input_uuids"


# -- manifest JSON and content hash ---------------------------------------------------------------------


def test_manifest_round_trip_keeps_every_field_and_type() -> None:
    bundle = sample_bundle()
    again = Bundle.from_json(bundle.to_json())
    assert math.isnan(again.values["nan"])
    strip = {k: v for k, v in bundle.values.items() if k != "nan"}
    assert {k: v for k, v in again.values.items() if k != "nan"} == strip
    assert type(again.values["epochs"]) is int and type(again.values["ok"]) is bool
    assert again.values["blob"] == b"\x00\xff"
    assert again.files == bundle.files and again.lineage == bundle.lineage
    assert (again.create_time, again.commit_time, again.remote_url, again.localized) == (
        bundle.create_time, bundle.commit_time, bundle.remote_url, bundle.localized)
    doc = json.loads(bundle.to_json())
    assert doc["values"]["blob"] == {"bytes": "AP8="}  # bytes as base64


def test_remote_manifest_leaves_out_local_state() -> None:
    doc = json.loads(sample_bundle().to_json(local_state=False))
    assert "remote_url" not in doc and "localized" not in doc
    pulled = Bundle.from_manifest(doc, context="other")
    assert pulled.context == "other" and pulled.remote_url is None and not pulled.localized


def test_malformed_manifest_raises_value_error() -> None:
    with pytest.raises(ValueError):
        Bundle.from_json(b"{not json")
    with pytest.raises(ValueError):
        Bundle.from_json(json.dumps({"format": 99}))
    with pytest.raises(ValueError):
        Bundle.from_json(json.dumps({"format": 1, "name": "x"}))


def test_content_hash_is_stable_and_typed() -> None:
    files = [FileEntry("a/x.txt", SHA_A, 10), FileEntry("b.onnx", SHA_B, 20, "application/onnx")]
    values = {"acc": 0.5, "n": 1}
    first = compute_content_hash(files, values)
    # order, sizes, media types, tags and lineage do not matter; paths, hashes and typed values do
    assert compute_content_hash(list(reversed(files)), dict(reversed(values.items()))) == first
    assert compute_content_hash(files, {"acc": 0.5, "n": 1.0}) != first
    assert compute_content_hash(files, {"acc": 0.5, "n": True}) != first
    assert compute_content_hash(files, {"acc": 0.5, "n": "1"}) != first
    assert compute_content_hash(files[:1], values) != first
    assert compute_content_hash([FileEntry("a/y.txt", SHA_A, 10), files[1]], values) != first


def test_content_hash_golden_value() -> None:
    """Pinned: the canonical encoding is sha256 of compact JSON with sorted [path, sha256] pairs and
    sorted [key, type, value] triples (bytes base64). Changing it would change every bundle's identity."""
    files = [FileEntry("model.onnx", SHA_A, 1)]
    canonical = '{"files":[["model.onnx","' + SHA_A + '"]],"values":[["acc","float",0.5],["raw","bytes","AQ=="]]}'
    expected = hashlib.sha256(canonical.encode()).hexdigest()
    assert expected == "cf1e710344b7b2ddf7239a415565339ad415d6660f080490e0fa914ab168baac"
    assert compute_content_hash(files, {"raw": b"\x01", "acc": 0.5}) == expected
