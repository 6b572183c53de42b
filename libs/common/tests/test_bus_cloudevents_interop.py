"""Our Kafka binding interoperates with the CloudEvents SDK's (cloudevents 2.x, core.bindings.kafka).

Why we keep our own codec (docs/architecture.md, "Events"): the SDK parses data only through a
``Format`` (JSON is the one it ships; none for protobuf), takes headers as a dict (Kafka allows
repeated headers; aiokafka hands a list), and has no notion of a poison record that must go to a
dead-letter topic. What we must not lose by keeping ours is interoperability, checked here both ways:
a consumer on the SDK reads our events, and we read the SDK's.
"""

from __future__ import annotations

from datetime import UTC, datetime

from cloudevents.core.bindings import kafka as sdk_kafka
from cloudevents.core.v1.event import CloudEvent as SdkCloudEvent
from opml.bundles.v1 import events_pb2

from opml_common.bus import CloudEvent


class RawBytes:
    """An SDK ``Format`` that leaves the data as bytes (the protobuf payload is ours to parse)."""

    def read_data(self, body: bytes, content_type: str | None) -> bytes:
        return body

    def write_data(self, data: bytes, content_type: str | None) -> bytes:
        return data

    def get_content_type(self) -> str:
        return "application/protobuf"


def test_an_sdk_consumer_reads_our_events() -> None:
    message = events_pb2.BundleDeleted(uuid="u1", bundle_name="defects")
    ours = CloudEvent.from_proto(message, source="opml/bundle-store", subject="defects", extensions={"tenant": "plant-a"})
    record = sdk_kafka.KafkaMessage(headers=dict(ours.kafka_headers()), key=ours.subject.encode(), value=ours.data)
    theirs = sdk_kafka.from_binary(record, RawBytes(), SdkCloudEvent)
    assert (theirs.get_id(), theirs.get_source(), theirs.get_type(), theirs.get_subject()) == (
        ours.id, "opml/bundle-store", "opml.bundles.v1.BundleDeleted", "defects")
    assert theirs.get_specversion() == "1.0"
    assert theirs.get_time() == ours.time
    assert theirs.get_datacontenttype() == "application/protobuf"
    assert theirs.get_extension("tenant") == "plant-a"
    assert events_pb2.BundleDeleted.FromString(theirs.get_data()) == message


def test_we_read_an_sdk_producers_events() -> None:
    message = events_pb2.BundleDeleted(uuid="u2")
    sent = SdkCloudEvent({"id": "e-42", "source": "/plants/a/line-3", "type": "opml.bundles.v1.BundleDeleted",
                          "specversion": "1.0", "time": datetime(2026, 12, 2, 1, 2, 3, 456000, tzinfo=UTC),
                          "subject": "line-3", "datacontenttype": "application/protobuf", "plant": "a"},
                         message.SerializeToString())
    record = sdk_kafka.to_binary(sent, RawBytes())
    ours = CloudEvent.from_kafka(list(record.headers.items()), record.value)
    assert (ours.id, ours.source, ours.type, ours.subject) == ("e-42", "/plants/a/line-3",
                                                               "opml.bundles.v1.BundleDeleted", "line-3")
    assert ours.time == datetime(2026, 12, 2, 1, 2, 3, 456000, tzinfo=UTC)
    assert ours.extensions["plant"] == "a"
    assert ours.parse(events_pb2.BundleDeleted) == message
