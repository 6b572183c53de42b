"""A host's predictions: recorded to its durable outbox while the router cannot be reached, then forwarded
through a real gRPC HostService, in order, each once, at the bounded rate (an in-process server stands
for the router; the netns test runs the whole path)."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
from opml.inference.v1 import events_pb2, hosts_pb2_grpc
from opml.inference.v1 import hosts_pb2 as pb

from opml_common.bus import CloudEvent
from opml_common.grpc.client import open_aio_channel
from opml_common.outbox import Outbox
from opml_devstack.devinfra import free_port
from opml_inference_router.hosts.forwarding import OutboxRecorder, RouterForwarder
from opml_inference_router_contract.topics import PREDICTIONS

RATE_EPS = 40.0


class Router(hosts_pb2_grpc.HostServiceServicer):
    def __init__(self) -> None:
        self.arrived: list[tuple[float, CloudEvent]] = []

    async def ForwardPredictions(self, request, context):
        for forwarded in request.events:
            event = CloudEvent.from_kafka([(h.key, h.value) for h in forwarded.headers], forwarded.data)
            self.arrived.append((time.monotonic(), event))
        return pb.ForwardPredictionsResponse(published=len(request.events))


async def serve(port: int, router: Router) -> grpc.aio.Server:
    server = grpc.aio.server()
    hosts_pb2_grpc.add_HostServiceServicer_to_server(router, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


async def test_predictions_wait_on_disk_while_cut_then_arrive_in_order_once_at_the_bounded_rate(tmp_path: Path) -> None:
    port = free_port()
    channel = open_aio_channel(f"127.0.0.1:{port}")
    outbox = Outbox(tmp_path / "outbox", RouterForwarder(channel, host="h1", token="", rate_eps=RATE_EPS), None,
                    retry_interval_s=0.2)
    recorder = OutboxRecorder(outbox, source="opml://inference-router/hosts/h1")
    await outbox.start()
    sent = []
    for index in range(20):  # the router is unreachable: each is on disk when publish_proto returns
        made = events_pb2.PredictionMade(request_id=f"edge-{index}", model_name="m", model_version="1")
        sent.append((await recorder.publish_proto(PREDICTIONS, made, subject="m/1")).id)
    assert len(list((tmp_path / "outbox").glob("*.json"))) == 20
    assert not await outbox.flush()  # nothing can go: all kept

    router = Router()
    server = await serve(port, router)  # the link returns
    try:
        deadline = time.monotonic() + 30
        while len(router.arrived) < 20 and time.monotonic() < deadline:
            await outbox.flush()
        assert [event.id for _, event in router.arrived] == sent  # in order, each once
        assert [event.parse(events_pb2.PredictionMade).request_id for _, event in router.arrived] == [
            f"edge-{i}" for i in range(20)]
        span = router.arrived[-1][0] - router.arrived[0][0]
        assert span >= 19 / RATE_EPS * 0.95, span  # paced: no faster than RATE_EPS events a second
        assert not list((tmp_path / "outbox").glob("*.json"))  # each deleted once acknowledged
    finally:
        await outbox.stop()
        await channel.close()
        await server.stop(None)
