"""Inputs that cost far more than they weigh (issue 16, item 3), sent to a REAL router process with its
real worker (real broker, S3 and Redis): each is refused with INVALID_ARGUMENT naming the field, in work
bounded by the declared sizes, and a model served beside the attacked one keeps its p99.

The attacks, as the issue describes them: a 430-byte model.yaml of nested aliases (10^8 leaves) and a
50,000-deep one, deployed; a ModelInfer whose BYTES input declares one element and carries 63 MB of
zero length prefixes; 62 MiB of tiny unknown protobuf fields; dims whose product overflows int64.
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from opml_common.errors import InvalidArgument
from opml_common.process import ServiceProcess
from opml_common.testing.services import TOKENS, ServiceStarter
from opml_inference_router.client import DeploymentClient
from opml_inference_router.kserve import encode_request
from opml_inference_router.testing import mlp_config, write_model_dir

FLEET = {
    "pool_kinds": [{"name": "cpu", "precisions": ["fp32"], "memory_mib": 2048, "slots": 2, "cost_per_hour": 0.4,
                    "execution_provider": "CPUExecutionProvider"}],
    "pools": [{"name": "cpu", "kind": "cpu", "workers": 1}],  # one worker: both models share its event loop
}
AUTH = (("authorization", f"Bearer {TOKENS['admin']}"),)


def alias_bomb() -> str:
    """A model.yaml whose ``name`` holds 10^8 leaves through nested aliases, in under 430 bytes."""
    lines = ["a: &a [" + ",".join(["lol"] * 10) + "]"]
    for level in range(1, 8):
        lines.append(f"{level}: &{level} [" + ",".join([f"*{level - 1 or 'a'}"] * 10) + "]")
    return "\n".join(lines) + "\nname: *7\n"


def echo_model() -> onnx.ModelProto:
    """A BYTES (string) model: ``text`` [batch, n] -> ``echo``, the same strings."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["text"], ["echo"])], "echo",
        [helper.make_tensor_value_info("text", TensorProto.STRING, ["batch", "n"])],
        [helper.make_tensor_value_info("echo", TensorProto.STRING, ["batch", "n"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def echo_config() -> dict:
    return {"name": "echo", "max_batch_size": 8,
            "inputs": [{"name": "text", "data_type": "string", "dims": [-1]}],
            "outputs": [{"name": "echo", "data_type": "string", "dims": [-1]}],
            "slo": {"p99_ms": 200.0}, "expected_rate_rps": 10.0, "pool_kinds": ["cpu"], "precisions": ["fp32"]}


@pytest.fixture
def router(start_service: ServiceStarter, tmp_path: Path) -> ServiceProcess:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump(FLEET))
    env = start_service.env("inference-router", extra_env={
        "OPML_INFERENCE_ROUTER_FLEET": str(fleet), "OPML_INFERENCE_ROUTER_WORKER_THREADS_PER_REPLICA": "1"})
    return start_service("inference-router", env=env)


def _refused(stub: service_pb2_grpc.GRPCInferenceServiceStub, request: pb.ModelInferRequest | bytes) -> str:
    """The INVALID_ARGUMENT message the router answers ``request`` with (bytes are sent as they are)."""
    call = stub.ModelInfer if isinstance(request, pb.ModelInferRequest) else stub.raw_infer
    with pytest.raises(grpc.RpcError) as caught:
        call(request, timeout=120, metadata=AUTH)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    return caught.value.details()


def _bytes_bomb() -> pb.ModelInferRequest:
    """One declared BYTES element, 63 MB of zero-length prefixes after it."""
    request = pb.ModelInferRequest(model_name="echo")
    request.inputs.add(name="text", datatype="BYTES", shape=[1, 1])
    request.raw_input_contents.append(b"\0\0\0\0" * (63_000_000 // 4))
    return request


def _unknown_fields_bomb() -> bytes:
    """A ModelInferRequest for ``mlp`` followed by 62 MiB of two-byte unknown varint fields (field 15)."""
    head = encode_request("mlp", {"features": np.zeros((1, 16), np.float32)}).SerializeToString()
    return head + b"\x78\x00" * (62 * 1024 * 1024 // 2)


def _overflow() -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="echo")
    request.inputs.add(name="text", datatype="BYTES", shape=[4, 1 << 62])  # 2^64 elements
    request.raw_input_contents.append(b"\0\0\0\0")
    return request


def _latencies(stub: service_pb2_grpc.GRPCInferenceServiceStub, count: int) -> list[float]:
    request = encode_request("mlp", {"features": np.ones((1, 16), np.float32)})
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        stub.ModelInfer(request, timeout=60, metadata=AUTH)
        samples.append(time.perf_counter() - start)
    return samples


def _p99(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=100)[98]


def _deploy(router: ServiceProcess, tmp_path: Path) -> None:
    """Refuses the two YAML attacks, then deploys ``mlp`` and ``echo`` on the one worker."""
    bomb_dir = tmp_path / "bomb"
    write_model_dir(bomb_dir, mlp_config("bomb", pool_kinds=("cpu",), precisions=("fp32",)))
    bomb = alias_bomb()
    assert len(bomb) <= 430
    (bomb_dir / "model.yaml").write_text(bomb)
    deep_dir = write_model_dir(tmp_path / "deep", mlp_config("deep", pool_kinds=("cpu",), precisions=("fp32",)))
    (deep_dir / "model.yaml").write_text("name: " + "[" * 50_000 + "]" * 50_000 + "\n")
    with DeploymentClient(router.target, token=TOKENS["admin"]) as client:
        for directory, rule in ((bomb_dir, "more than 100000 nodes"), (deep_dir, "nests deeper than")):
            with pytest.raises(InvalidArgument) as caught:
                client.deploy(model_dir=str(directory))
            assert caught.value.field.endswith("model.yaml") and rule in caught.value.message, caught.value
        client.deploy(model_dir=str(write_model_dir(
            tmp_path / "mlp", mlp_config("mlp", pool_kinds=("cpu",), precisions=("fp32",), max_queue_delay_us=None))))
        client.deploy(model_dir=str(write_model_dir(tmp_path / "echo", echo_config(), echo_model())))


def _channel(router: ServiceProcess) -> grpc.Channel:
    return grpc.insecure_channel(router.target, options=[("grpc.max_send_message_length", 64 << 20),
                                                         ("grpc.max_receive_message_length", 64 << 20)])


def _stub(channel: grpc.Channel) -> service_pb2_grpc.GRPCInferenceServiceStub:
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    stub.raw_infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")  # bytes as they are
    return stub


def _p99_ratio(stub: service_pb2_grpc.GRPCInferenceServiceStub, bombs: list) -> float:
    """mlp's p99 while ``bombs`` are sent in turn beside it, over its p99 alone (same router, same test)."""
    _latencies(stub, 50)  # warm-up
    baseline = _latencies(stub, 300)
    done, started, attacks = threading.Event(), threading.Event(), [0]

    def attack() -> None:
        while not done.is_set():
            _refused(stub, bombs[attacks[0] % len(bombs)])
            attacks[0] += 1
            started.set()

    attacker = threading.Thread(target=attack, daemon=True)
    attacker.start()
    assert started.wait(120)
    try:
        attacked: list[float] = []
        while attacks[0] < 12 or len(attacked) < 300:  # enough of both for the comparison
            attacked += _latencies(stub, 20)
    finally:
        done.set()
        attacker.join(120)
    ratio = _p99(attacked) / _p99(baseline)
    print(f"mlp p99 alone {_p99(baseline) * 1e3:.2f} ms, beside {attacks[0]} attacks {_p99(attacked) * 1e3:.2f} ms "
          f"({ratio:.1f}x)")
    return ratio


def test_costly_inputs_are_refused_and_the_other_model_keeps_its_p99(router: ServiceProcess, tmp_path: Path) -> None:
    _deploy(router, tmp_path)
    with _channel(router) as channel:
        stub = _stub(channel)
        echo = pb.ModelInferRequest(model_name="echo")
        echo.inputs.add(name="text", datatype="BYTES", shape=[1, 2])
        echo.raw_input_contents.append(b"\x02\0\0\0hi\x00\0\0\0")
        answer = stub.ModelInfer(echo, timeout=60, metadata=AUTH)
        assert [(o.name, list(o.shape)) for o in answer.outputs] == [("echo", [1, 2])]  # a well-formed one serves

        # Each attack, once, with the field named.
        assert "inputs[text]: BYTES contents hold 62999996 bytes after the 1 elements" in _refused(stub, _bytes_bomb())
        assert _refused(stub, _overflow()).startswith("inputs[text].shape: declares more elements than a tensor "
                                                      "may hold: the product of dims [4,4611686018427387904] "
                                                      "overflows int64")
        assert "more than 4096 top-level fields" in _refused(stub, _unknown_fields_bomb())
        # Before the bounds one such request stalled the router 6.9 s (a ratio near 700 here). What is left is
        # moving a 62 MiB message through gRPC (~250 ms on 2 shared cores), which only a smaller message cap
        # than the platform's 64 MiB would bound further: hence the generous factor.
        assert _p99_ratio(stub, [_unknown_fields_bomb(), _overflow()]) < 100


@pytest.mark.xfail(strict=True, reason="not yet bounded: a 63 MB request is still forwarded to the worker whole "
                   "(about 1 s end to end on 2 cores), so a stream of them raises a co-hosted model's p99 "
                   "~200x even though decoding it now costs one element; needs a per-model request-size "
                   "cap at the router frontend")
def test_a_stream_of_63_mb_bytes_requests_leaves_the_other_model_p99(router: ServiceProcess, tmp_path: Path) -> None:
    _deploy(router, tmp_path)
    with _channel(router) as channel:
        assert _p99_ratio(_stub(channel), [_bytes_bomb()]) < 25
