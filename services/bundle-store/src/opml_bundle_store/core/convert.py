"""Conversions between the core's dataclasses and the opml.bundles.v1 messages (no logic but a time's range).

Protobuf only (no grpc): the servicer converts replies with it and the core builds its events with it.
A typed value's message is the contract's (:mod:`opml_bundle_store_contract.values`): clients build it too.
"""

from __future__ import annotations

from datetime import UTC, datetime

from google.protobuf.timestamp_pb2 import Timestamp
from opml.bundles.v1 import bundles_pb2 as pb

from opml_bundle_store.core.manifest import Bundle, ContextInfo, FileEntry, Lineage
from opml_bundle_store_contract.values import value_to_proto
from opml_common.errors import InvalidArgument


def _timestamp(moment: datetime | None) -> Timestamp | None:
    if moment is None:
        return None
    stamp = Timestamp()
    stamp.FromDatetime(moment.astimezone(UTC))
    return stamp


def _datetime(stamp: Timestamp, present: bool, field: str) -> datetime | None:
    """Raises: InvalidArgument naming ``field``: the stamp is out of Timestamp's range (a datetime's)."""
    if not present:
        return None
    try:
        return stamp.ToDatetime(tzinfo=UTC)
    except ValueError:
        raise InvalidArgument(field, f"`{field}` must be a time from 0001-01-01 to 9999-12-31 UTC (nanos 0 to "
                                     f"999999999), but got seconds={stamp.seconds}, nanos={stamp.nanos}.") from None


def lineage_to_proto(lineage: Lineage) -> pb.Lineage:
    return pb.Lineage(input_uuids=list(lineage.input_uuids), code_version=lineage.code_version,
                      parameters=dict(lineage.parameters), creator=lineage.creator,
                      start_time=_timestamp(lineage.start_time), stop_time=_timestamp(lineage.stop_time))


def lineage_from_proto(message: pb.Lineage, field: str) -> Lineage:
    """Raises: InvalidArgument naming ``field``.start_time or .stop_time when out of range."""
    return Lineage(
        input_uuids=tuple(message.input_uuids), code_version=message.code_version,
        parameters=dict(message.parameters), creator=message.creator,
        start_time=_datetime(message.start_time, message.HasField("start_time"), f"{field}.start_time"),
        stop_time=_datetime(message.stop_time, message.HasField("stop_time"), f"{field}.stop_time"),
    )


def file_to_proto(entry: FileEntry) -> pb.BundleFile:
    return pb.BundleFile(path=entry.path, sha256=entry.sha256, size_bytes=entry.size, media_type=entry.media_type)


def bundle_to_proto(bundle: Bundle) -> pb.Bundle:
    return pb.Bundle(
        name=bundle.resource_name,
        context=bundle.context,
        bundle_name=bundle.name,
        uuid=bundle.uuid,
        tags=dict(bundle.tags),
        files=[file_to_proto(f) for f in bundle.files],
        values={k: value_to_proto(v) for k, v in bundle.values.items()},
        lineage=lineage_to_proto(bundle.lineage),
        content_hash=bundle.content_hash,
        committed=bundle.committed,
        create_time=_timestamp(bundle.create_time),
        commit_time=_timestamp(bundle.commit_time),
        remote_url=bundle.remote_url or "",
        localized=bundle.localized,
    )


def context_to_proto(info: ContextInfo) -> pb.Context:
    return pb.Context(name=f"contexts/{info.name}", remote_url=info.remote_url or "", bundle_count=info.bundle_count)
