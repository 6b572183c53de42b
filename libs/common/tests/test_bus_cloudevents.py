"""CloudEvents 1.0 Kafka binding (binary mode): headers, validation, parsing. No broker needed."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from opml.bundles.v1 import bundles_pb2, events_pb2

from opml_common.bus import CloudEvent, MalformedEvent, is_retriable
from opml_common.errors import InvalidArgument, Unavailable


def _committed(name: str = "defects") -> events_pb2.BundleCommitted:
    return events_pb2.BundleCommitted(
        bundle=bundles_pb2.Bundle(name=f"contexts/c/bundles/{name}", bundle_name=name, tags={"line": "4"})
    )


def _headers(event: CloudEvent) -> dict[str, bytes]:
    return dict(event.kafka_headers())


def test_from_proto_fills_the_attributes():
    message = _committed()
    event = CloudEvent.from_proto(message, source="bundle-store", subject="defects", extensions={"tenant": "acme"})
    assert event.type == "opml.bundles.v1.BundleCommitted"
    assert event.dataschema == "proto:opml.bundles.v1.BundleCommitted"
    assert event.datacontenttype == "application/protobuf"
    assert event.data == message.SerializeToString()
    assert event.time.tzinfo is not None and abs(datetime.now(UTC) - event.time) < timedelta(seconds=5)
    assert len(event.id) == 36  # uuid4
    assert CloudEvent.from_proto(message, source="s").id != CloudEvent.from_proto(message, source="s").id
    assert CloudEvent.from_proto(message, source="s", id="fixed").id == "fixed"


def test_kafka_headers_round_trip():
    event = CloudEvent.from_proto(_committed(), source="bundle-store", subject="défauts",
                                  extensions={"tenant": "acme", "traceparent": "00-abc-def-01"})
    headers = event.kafka_headers()
    assert all(isinstance(name, str) and isinstance(value, bytes) for name, value in headers)
    named = dict(headers)
    assert named["ce_specversion"] == b"1.0"
    assert named["ce_id"] == event.id.encode()
    assert named["ce_source"] == b"bundle-store"
    assert named["ce_type"] == b"opml.bundles.v1.BundleCommitted"
    assert named["ce_subject"] == "défauts".encode()
    assert named["ce_dataschema"] == b"proto:opml.bundles.v1.BundleCommitted"
    assert named["content-type"] == b"application/protobuf"
    assert named["ce_tenant"] == b"acme"
    assert named["ce_time"].endswith(b"Z")

    back = CloudEvent.from_kafka(headers, event.data)
    assert back == event
    assert back.parse(events_pb2.BundleCommitted) == _committed()


def test_optional_attributes_are_left_out_and_read_back_as_none():
    event = CloudEvent(id="1", source="s", type="t", time=datetime(2024, 5, 1, tzinfo=UTC), data=b"")
    named = _headers(event)
    assert "ce_subject" not in named and "ce_dataschema" not in named
    assert named["ce_time"] == b"2024-05-01T00:00:00.000000Z"
    back = CloudEvent.from_kafka(event.kafka_headers(), None)
    assert back.subject is None and back.dataschema is None and back.data == b""


def test_time_with_offset_is_normalized_to_utc():
    event = CloudEvent(id="1", source="s", type="t", data=b"",
                       time=datetime(2024, 5, 1, 14, 0, tzinfo=timezone(timedelta(hours=2))))
    assert _headers(event)["ce_time"] == b"2024-05-01T12:00:00.000000Z"
    headers = [(k, v) for k, v in event.kafka_headers() if k != "ce_time"] + [("ce_time", b"2024-05-01T14:00:00+02:00")]
    assert CloudEvent.from_kafka(headers, b"").time == event.time


def _without(event: CloudEvent, name: str) -> list[tuple[str, bytes]]:
    return [(k, v) for k, v in event.kafka_headers() if k != name]


def _replace(event: CloudEvent, name: str, value: bytes) -> list[tuple[str, bytes]]:
    return _without(event, name) + [(name, value)]


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        (lambda e: _without(e, "ce_id"), "ce_id"),
        (lambda e: _replace(e, "ce_id", b""), "ce_id"),
        (lambda e: _without(e, "ce_source"), "ce_source"),
        (lambda e: _without(e, "ce_type"), "ce_type"),
        (lambda e: _without(e, "ce_specversion"), "ce_specversion"),
        (lambda e: _replace(e, "ce_specversion", b"0.3"), "'0.3'"),
        (lambda e: _replace(e, "ce_time", b"yesterday"), "RFC 3339"),
        (lambda e: _replace(e, "ce_time", b"2024-05-01T12:00:00"), "UTC offset"),
        (lambda e: _replace(e, "ce_source", b"\xff\xfe"), "UTF-8"),
        (lambda e: _without(e, "ce_time"), "ce_time"),
        (lambda e: [], "ce_specversion"),
    ],
)
def test_from_kafka_rejects_malformed_headers(headers, expected):
    event = CloudEvent.from_proto(_committed(), source="bundle-store")
    with pytest.raises(MalformedEvent, match=expected):
        CloudEvent.from_kafka(headers(event), event.data)


def test_missing_time_falls_back_to_the_record_timestamp():
    event = CloudEvent.from_proto(_committed(), source="bundle-store")
    back = CloudEvent.from_kafka(_without(event, "ce_time"), event.data, timestamp_ms=1_714_564_800_000)
    assert back.time == datetime(2024, 5, 1, 12, 0, tzinfo=UTC)


def test_from_kafka_ignores_other_headers_and_reads_extensions():
    event = CloudEvent.from_proto(_committed(), source="bundle-store")
    headers = event.kafka_headers() + [("traceparent-x", b"zzz"), ("opml_error", b"x"), ("ce_region", b"eu")]
    back = CloudEvent.from_kafka(headers, event.data)
    assert dict(back.extensions) == {"region": "eu"}


def test_parse_rejects_a_type_mismatch():
    event = CloudEvent.from_proto(_committed(), source="bundle-store")
    with pytest.raises(MalformedEvent, match="opml.bundles.v1.BundleDeleted"):
        event.parse(events_pb2.BundleDeleted)


def test_parse_rejects_bytes_that_do_not_parse():
    event = CloudEvent(id="1", source="s", type="opml.bundles.v1.BundleCommitted",
                       time=datetime.now(UTC), data=b"\x0a\xff")
    with pytest.raises(MalformedEvent, match="does not parse"):
        event.parse(events_pb2.BundleCommitted)


def test_parse_reads_protobuf_json_and_rejects_other_content_types():
    base = {"id": "1", "source": "s", "type": "opml.bundles.v1.BundleDeleted", "time": datetime.now(UTC)}
    event = CloudEvent(**base, data=b'{"context": "c", "bundleName": "b"}', datacontenttype="application/json")
    assert event.parse(events_pb2.BundleDeleted) == events_pb2.BundleDeleted(context="c", bundle_name="b")
    with pytest.raises(MalformedEvent, match="does not parse"):
        CloudEvent(**base, data=b"{nope", datacontenttype="application/json").parse(events_pb2.BundleDeleted)
    with pytest.raises(MalformedEvent, match="content-type"):
        CloudEvent(**base, data=b"", datacontenttype="text/plain").parse(events_pb2.BundleDeleted)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"id": ""}, "id"),
        ({"source": ""}, "source"),
        ({"time": datetime(2024, 1, 1)}, "time"),
        ({"extensions": {"Bad-Name": "x"}}, "extension"),
        ({"extensions": {"id": "x"}}, "extension"),
    ],
)
def test_constructor_validates(changes, field):
    kwargs = {"id": "1", "source": "s", "type": "t", "time": datetime.now(UTC), "data": b""}
    with pytest.raises(ValueError, match=field):
        CloudEvent(**{**kwargs, **changes})


def test_extensions_are_frozen_copies():
    extensions = {"tenant": "acme"}
    event = CloudEvent.from_proto(_committed(), source="s", extensions=extensions)
    extensions["tenant"] = "other"
    assert event.extensions["tenant"] == "acme"
    with pytest.raises(TypeError):
        event.extensions["tenant"] = "x"  # type: ignore[index]


def test_retriable_classification():
    import redis.exceptions

    assert not is_retriable(MalformedEvent("x"))
    assert not is_retriable(InvalidArgument("f", "bad"))
    assert is_retriable(Unavailable("down"))
    assert is_retriable(ConnectionResetError())
    assert is_retriable(redis.exceptions.ConnectionError())
    assert not is_retriable(KeyError("bug"))
