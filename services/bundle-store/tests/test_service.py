"""The bundle-store service end to end: a real process, real tansu, SeaweedFS and Redis."""

from __future__ import annotations

import asyncio
import hashlib
import re
import urllib.request
from pathlib import Path

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opml.bundles.v1 import bundles_pb2 as pb
from opml.bundles.v1 import bundles_pb2_grpc, events_pb2
from prometheus_client import CollectorRegistry

from opml_bundle_store.__main__ import SPEC, build
from opml_bundle_store.core.store import BundleStore
from opml_bundle_store.settings import BundleStoreSettings
from opml_bundle_store_contract.client import BundleStoreClient
from opml_bundle_store_contract.topics import BUNDLES
from opml_common.bus import CloudEvent
from opml_common.config import PlatformSettings
from opml_common.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, Unauthenticated
from opml_common.metrics import ServiceMetrics
from opml_common.outbox import write_event
from opml_common.service import serve
from opml_devstack.testing.bus import read_records


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _bytes_moved(bundle_store) -> dict[str, float]:
    port = bundle_store.env["OPML_BUNDLE_STORE_METRICS_PORT"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {m[0]: float(m[1]) for m in re.findall(r'opml_bundle_store_transfer_bytes_total\{direction="(\w+)"\} (\S+)', text)}


def test_round_trip_across_two_contexts_with_events(bundle_store, admin: BundleStoreClient, remote_url: str,
                                                    platform_settings, tmp_path: Path) -> None:
    files = {"model/weights.bin": bytes(range(256)) * 4096, "metrics.json": b'{"accuracy": 0.97}',
             "empty.txt": b""}
    before = _bytes_moved(bundle_store)
    admin.create_context("plant-a", remote_url)
    admin.create_context("plant-b", remote_url)
    added = admin.add("plant-a", "classifier", files, values={"accuracy": 0.97, "epochs": 3, "ok": True},
                      tags={"stage": "candidate"}, commit=True)
    assert added.committed and {f.path: f.sha256 for f in added.files} == {p: _sha(d) for p, d in files.items()}
    assert added.lineage.creator not in ("", "anonymous")  # the server's name for the caller

    progress = list(admin.push("plant-a", added.uuid))
    assert progress[-1].done and [b.uuid for b in progress[-1].bundles] == [added.uuid]
    assert progress[-1].bytes_done == progress[-1].bytes_total == sum(map(len, files.values()))

    pulled = list(admin.pull("plant-b", "classifier", localize=True))[-1]
    assert [b.uuid for b in pulled.bundles] == [added.uuid]
    copy = admin.get_bundle("plant-b", "classifier")
    assert copy.uuid == added.uuid and copy.content_hash == added.content_hash and copy.localized
    assert copy.values["accuracy"].float_value == 0.97 and copy.values["ok"].bool_value
    written = admin.download("plant-b", added.uuid, tmp_path / "out")
    assert {p.relative_to(tmp_path / "out").as_posix(): p.read_bytes() for p in written} == files
    after, size = _bytes_moved(bundle_store), sum(map(len, files.values()))
    assert {d: after[d] - before.get(d, 0) for d in after} == {"upload": size, "push": size, "pull": size,
                                                               "read": size}

    assert admin.delete("plant-a", added.uuid) == [added.uuid]
    records = asyncio.run(read_records(platform_settings, BUNDLES.full_name(platform_settings.topic_prefix), 3))
    events = sorted((CloudEvent.from_kafka(r.headers, r.value) for r in records), key=lambda e: e.time)
    assert [e.type for e in events] == ["opml.bundles.v1.BundleCommitted", "opml.bundles.v1.BundlePushed",
                                        "opml.bundles.v1.BundleDeleted"]
    assert all(e.subject == "classifier" and e.source == "opml/bundle-store" for e in events)
    committed = events[0].parse(events_pb2.BundleCommitted)
    assert committed.bundle.uuid == added.uuid and committed.bundle.tags["stage"] == "candidate"
    pushed = events[1].parse(events_pb2.BundlePushed)
    assert pushed.remote_url == remote_url and {f.media_type for f in pushed.bundle.files} >= {"application/json"}
    assert events[2].parse(events_pb2.BundleDeleted).uuid == added.uuid


def test_ls_filters_latest_and_lineage(writer: BundleStoreClient) -> None:
    writer.create_context("lab")
    data = writer.add("lab", "dataset", {"rows.csv": b"a,b\n1,2\n"}, commit=True)
    first = writer.add("lab", "model", {"w": b"1"}, tags={"algo": "cnn"},
                       lineage=pb.Lineage(input_uuids=[data.uuid]), commit=True)
    second = writer.add("lab", "model", {"w": b"2"}, tags={"algo": "cnn"},
                        lineage=pb.Lineage(input_uuids=[data.uuid]))
    assert [b.uuid for b in writer.list_bundles("lab", bundle_name="model")] == [second.uuid, first.uuid]
    assert [b.uuid for b in writer.list_bundles("lab", bundle_name="model", committed_only=True)] == [first.uuid]
    assert writer.get_bundle("lab", "model").uuid == first.uuid  # latest committed wins
    assert {b.bundle_name for b in writer.list_bundles("lab", latest_only=True)} == {"dataset", "model"}
    assert len(writer.list_bundles("lab", tags={"algo": "cnn"})) == 2
    graph = writer.lineage("lab", data.uuid, direction=pb.GetLineageRequest.DOWNSTREAM)
    assert {(e.input_uuid, e.output_uuid) for e in graph.edges} == {(data.uuid, first.uuid), (data.uuid, second.uuid)}
    up = writer.lineage("lab", first.uuid, direction=pb.GetLineageRequest.UPSTREAM)
    assert {(e.input_uuid, e.output_uuid) for e in up.edges} == {(data.uuid, first.uuid)}


@pytest.mark.parametrize("call, field", [
    (lambda c: c.create_context("Bad Name!"), "context_id"),
    (lambda c: c.stub.GetContext(pb.GetContextRequest(name="ctx/x")), "name"),
    (lambda c: c.stub.ListBundles(pb.ListBundlesRequest(parent="contexts/lab", page_size=-5)), "page_size"),
    (lambda c: c.stub.ListBundles(pb.ListBundlesRequest(parent="contexts/lab", page_token="garbage")), "page_token"),
    (lambda c: c.add("lab", "bad name", {"a": b"1"}), "bundle_name"),
    (lambda c: c.add("lab", "ok", {"../escape": b"1"}), "path"),
    (lambda c: c.stub.GarbageCollect(pb.GarbageCollectRequest(parent="contexts/lab", grace_seconds=-1)),
     "grace_seconds"),
    (lambda c: c.add("lab", "ok", {"a": b"1"}, lineage=pb.Lineage(start_time=Timestamp(seconds=10**15))),
     "header.lineage.start_time"),
    (lambda c: c.add("lab", "ok", {"a": b"1"}, lineage=pb.Lineage(stop_time=Timestamp(nanos=-1))),
     "header.lineage.stop_time"),
])
def test_bad_arguments_are_invalid_argument_naming_the_field(admin: BundleStoreClient, call, field: str) -> None:
    admin.create_context("lab")
    with pytest.raises(InvalidArgument) as caught:  # the client's stub raises domain errors
        call(admin)
    assert field in caught.value.field, caught.value.message


def test_damaged_upload_is_rejected_and_leaves_nothing(admin: BundleStoreClient) -> None:
    admin.create_context("lab")
    header = pb.AddBundleHeader(parent="contexts/lab", bundle_name="model", files=[
        pb.BundleFile(path="w.bin", size_bytes=4, sha256=_sha(b"good"))])
    requests = [pb.AddBundleRequest(header=header),
                pb.AddBundleRequest(chunk=pb.FileChunk(file_index=0, data=b"evil"))]
    with pytest.raises(InvalidArgument) as caught:  # INVALID_ARGUMENT, as a domain error
        admin.stub.AddBundle(iter(requests))
    assert "w.bin" in caught.value.message
    assert admin.list_bundles("lab") == []


def test_interrupted_upload_leaves_no_bundle(admin: BundleStoreClient, bundle_store, tokens) -> None:
    admin.create_context("lab")
    header = pb.AddBundleHeader(parent="contexts/lab", bundle_name="model", files=[
        pb.BundleFile(path="big.bin", size_bytes=8 * 1024 * 1024)])

    def requests():
        yield pb.AddBundleRequest(header=header)
        yield pb.AddBundleRequest(chunk=pb.FileChunk(file_index=0, data=b"x" * 1024 * 1024))
        raise RuntimeError("client crashed mid-upload")

    with grpc.insecure_channel(bundle_store.target) as channel:
        stub = bundles_pb2_grpc.BundleStoreStub(channel)
        with pytest.raises(grpc.RpcError):
            stub.AddBundle(requests(), metadata=[("authorization", f"Bearer {tokens['admin']}")])
    assert admin.list_bundles("lab") == []
    # The service is still healthy and accepts the next upload.
    assert admin.add("lab", "model", {"big.bin": b"y" * 10}).bundle_name == "model"


def test_roles_are_enforced(bundle_store, admin: BundleStoreClient, tokens) -> None:
    admin.create_context("lab")
    added = admin.add("lab", "model", {"w": b"1"}, commit=True)
    with BundleStoreClient(bundle_store.target, token=tokens["writer"]) as writer:
        with pytest.raises(PermissionDenied, match="DeleteBundle needs the admin role"):
            writer.delete("lab", added.uuid)
        with pytest.raises(PermissionDenied):
            writer.gc("lab")
    with BundleStoreClient(bundle_store.target, token=tokens["reader"]) as reader:
        assert reader.get_bundle("lab", added.uuid).uuid == added.uuid
        with pytest.raises(PermissionDenied):
            reader.add("lab", "model", {"w": b"2"})
    with BundleStoreClient(bundle_store.target) as anonymous, pytest.raises(Unauthenticated):
        anonymous.list_contexts()
    assert admin.get_bundle("lab", added.uuid).uuid == added.uuid  # nothing was deleted
    with pytest.raises(NotFound, match="no-such"):
        admin.get_bundle("lab", "no-such")


def test_health_reflection_and_metrics(bundle_store, admin: BundleStoreClient, settings_env) -> None:
    admin.list_contexts()
    with grpc.insecure_channel(bundle_store.target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="opml.bundles.v1.BundleStore"))
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        services = {s.name for s in next(replies).list_services_response.service}
        assert "opml.bundles.v1.BundleStore" in services
    port = bundle_store.env["OPML_BUNDLE_STORE_METRICS_PORT"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'opml_bundle_store_grpc_requests_total{code="OK",method="ListContexts"}' in text
    assert "opml_bundle_store_grpc_request_duration_seconds_bucket" in text


async def test_a_second_instance_on_a_home_in_use_stops_before_opening_its_outbox(
        platform_settings: PlatformSettings, tmp_path: Path) -> None:
    """The home is owned (its lock held, here by an open store): a second service on it refuses to
    start before it opens the outbox there, so it neither publishes nor races for the owner's pending
    events (nor deletes them)."""
    home = tmp_path / "home"
    (home / "outbox").mkdir(parents=True)
    event = CloudEvent.from_proto(events_pb2.BundleDeleted(uuid="u"), source="test", subject="s")
    pending = write_event(home / "outbox", BUNDLES, event, 0)
    settings = BundleStoreSettings(home=home, grpc_port=0, metrics_port=0)
    with BundleStore(home, None), pytest.raises(FailedPrecondition, match="in use by another BundleStore"):
        await serve(SPEC, build, settings=settings, platform=platform_settings,
                    metrics=ServiceMetrics(SPEC.name, CollectorRegistry()))
    assert pending.exists()
    with BundleStore(home, None):
        pass  # and it released what it took: the home can be opened again
