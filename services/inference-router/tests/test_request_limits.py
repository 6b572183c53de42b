"""A model's request size limit: computed from its config, checked by the router from the request's
length before anything is copied or forwarded; the router's gRPC receive cap from its settings.
(The attack on a real router process is in test_costly_inputs.py.)"""

from __future__ import annotations

import random

import pytest

from opml_common.config import PlatformSettings, ServiceSettings
from opml_common.errors import InvalidArgument
from opml_common.grpc.server import MAX_MESSAGE_BYTES, GrpcServer
from opml_devstack.testing.bus import fresh_metrics, sample
from opml_inference_router.routing import ModelPolicy, Replica, Router, wire
from opml_inference_router.routing.limits import (
    DEFAULT_GRPC_MAX_RECEIVE_BYTES,
    DEFAULT_MAX_REQUEST_BYTES,
    HEADER_ALLOWANCE,
    RequestLimit,
    largest,
    request_limit,
)
from opml_inference_router.settings import RouterSettings
from opml_inference_router.testing import mlp_config
from opml_inference_router_contract.model_config import ModelConfig


def config(**changes: object) -> ModelConfig:
    return ModelConfig.from_dict({**mlp_config("m"), **changes})


def test_a_fixed_size_model_gets_batch_times_dims_times_item_size_plus_the_header() -> None:
    limit = request_limit(config())  # max_batch_size 32, features fp32 [16]
    assert limit.bytes == 32 * 16 * 4 + HEADER_ALLOWANCE
    assert limit.basis == "max_batch_size 32 x its inputs' fixed dims x item size, 2048 bytes, + 65536 for the header"
    two = config(max_batch_size=0, dynamic_batching=None, inputs=[{"name": "a", "data_type": "fp16", "dims": [3, 5]},
                                           {"name": "b", "data_type": "int8", "dims": [7]}])
    # No batch dimension: one row. int8 may come as typed int_contents, a varint of up to 10 bytes.
    assert request_limit(two).bytes == 3 * 5 * 2 + 7 * 10 + HEADER_ALLOWANCE


def test_bytes_and_dynamic_inputs_get_the_default_and_the_config_can_set_its_own() -> None:
    text = config(inputs=[{"name": "text", "data_type": "string", "dims": [1]},
                          {"name": "image", "data_type": "fp32", "dims": [3, -1]}])
    limit = request_limit(text, default=1000)
    assert limit.bytes == 1000 and "(text, image: BYTES or a -1 dim)" in limit.basis
    assert request_limit(text).bytes == DEFAULT_MAX_REQUEST_BYTES == 4 << 20
    assert request_limit(config(max_request_bytes=12345), default=1000) == RequestLimit(
        12345, "max_request_bytes of its config")
    with pytest.raises(InvalidArgument) as caught:
        config(max_request_bytes=0)
    assert caught.value.field == "max_request_bytes"


def test_capped_and_largest() -> None:
    limit = RequestLimit(100, "x")
    assert limit.capped(200, "cap") is limit
    assert limit.capped(50, "cap") == RequestLimit(50, "cap, below the 100 bytes of x")
    assert largest([RequestLimit(5, "a"), RequestLimit(9, "b")]) == RequestLimit(9, "b")
    assert largest([]) is None


class Recording(Replica):
    def __init__(self) -> None:
        self.name = "w"
        self.requests: list[bytes] = []

    async def call(self, method: str, request: bytes, *, timeout_s: float) -> bytes:
        self.requests.append(request)
        return wire.encode_field(wire.MODEL_NAME, "m")

    async def close(self) -> None:
        pass


def _request(size: int) -> bytes:
    """A request for ``m`` of exactly ``size`` bytes (an unknown field 15 pads it)."""
    head = wire.encode_field(wire.MODEL_NAME, "m")
    pad = size - len(head) - 4
    return head + b"\x7a" + bytes([0x80 | (pad & 0x7F), 0x80 | (pad >> 7 & 0x7F), pad >> 14]) + b"\0" * pad


def _router(**limits: int) -> tuple[Router, Recording, object]:
    metrics, registry = fresh_metrics("inference-router")
    replica = Recording()
    router = Router(connect=lambda _address: replica, metrics=metrics, rng=random.Random(1), **limits)
    return router, replica, registry


async def test_the_router_refuses_a_longer_request_before_forwarding_it() -> None:
    router, replica, registry = _router()
    router.set_model("m", ModelPolicy.for_model(config()))
    router.add_replica("m", "1", "w")
    limit = 32 * 16 * 4 + HEADER_ALLOWANCE
    await router.infer("m", "", _request(limit))  # at the limit: forwarded
    assert len(replica.requests) == 1
    with pytest.raises(InvalidArgument) as caught:
        await router.infer("m", "", _request(limit + 1))
    assert caught.value.field == "request"
    assert caught.value.message.startswith(f"request: is {limit + 1} bytes, more than model 'm' accepts: "
                                           f"{limit} bytes (max_batch_size 32 x its inputs' fixed dims x item size")
    assert len(replica.requests) == 1  # never forwarded
    assert sample(registry, "opml_inference_router_requests_total", model="m", version="1",
                  code="INVALID_ARGUMENT") == 1
    assert router.describe("m")["max_request_bytes"] == limit


async def test_without_a_limit_the_router_default_applies_and_none_passes_the_receive_cap() -> None:
    router, replica, _ = _router(max_request_bytes=3000, max_receive_bytes=5000)
    router.set_model("m", ModelPolicy())
    router.add_replica("m", "1", "w")
    with pytest.raises(InvalidArgument, match="more than model 'm' accepts: 3000 bytes .the router's default, "
                                              "OPML_INFERENCE_ROUTER_MAX_REQUEST_BYTES"):
        await router.infer("m", "1", _request(3001))
    router.set_model("m", ModelPolicy(max_request=RequestLimit(10**9, "max_request_bytes of its config")))
    with pytest.raises(InvalidArgument, match="more than model 'm' accepts: 5000 bytes .the router's gRPC message "
                                              "cap, OPML_INFERENCE_ROUTER_GRPC_MAX_RECEIVE_BYTES, below the "
                                              "1000000000 bytes of max_request_bytes of its config"):
        await router.infer("m", "1", _request(5001))
    await router.infer("m", "1", _request(5000))
    assert len(replica.requests) == 1


async def test_the_router_server_receive_cap_comes_from_its_settings() -> None:  # grpc.aio needs a loop
    platform = PlatformSettings(auth_tokens="", log_level="WARNING")
    router = GrpcServer(settings=RouterSettings(grpc_port=0, metrics_port=0), platform=platform,
                        metrics=fresh_metrics("inference-router")[0], registrations=[])
    assert router.max_receive_message_bytes == DEFAULT_GRPC_MAX_RECEIVE_BYTES == 16 << 20
    other = GrpcServer(settings=ServiceSettings(), platform=platform, metrics=fresh_metrics("x")[0], registrations=[])
    assert other.max_receive_message_bytes == MAX_MESSAGE_BYTES == 64 << 20  # every other service: as before
    given = GrpcServer(settings=ServiceSettings(), platform=platform, metrics=fresh_metrics("y")[0], registrations=[],
                       max_receive_message_bytes=1 << 20)
    assert given.max_receive_message_bytes == 1 << 20
