"""Inputs that cost far more than they weigh (issue 16, item 3), sent to a REAL router process with its
real worker (real broker, S3 and Redis): each is refused with INVALID_ARGUMENT naming the field, in work
bounded by the declared sizes, and a model served beside the attacked one keeps its p99.

The attacks, as the issue describes them: a 430-byte model.yaml of nested aliases (10^8 leaves) and a
50,000-deep one, deployed; a ModelInfer whose BYTES input declares one element and carries 63 MB of
zero length prefixes; 62 MiB of tiny unknown protobuf fields; dims whose product overflows int64.

The first test runs the router with the platform's 64 MiB message cap (an operator who raised it), so
the 63 MB and 62 MiB messages reach the bounds behind it (the header walk, the worker's decode); the
second runs it as shipped: its 16 MiB gRPC cap and each model's request size limit refuse a stream of
63 MB requests before they cost the co-hosted model anything.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
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
from opml_devstack.process import ServiceProcess
from opml_devstack.testing.metrics import samples, scrape_router
from opml_devstack.testing.services import TOKENS, ServiceStarter
from opml_inference_router.kserve import encode_request
from opml_inference_router.testing import mlp_config, write_model_dir
from opml_inference_router_contract.client import DeploymentClient

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


def echo_config(**extra: object) -> dict:
    return {"name": "echo", "max_batch_size": 8,
            "inputs": [{"name": "text", "data_type": "string", "dims": [-1]}],
            "outputs": [{"name": "echo", "data_type": "string", "dims": [-1]}],
            "slo": {"p99_ms": 200.0}, "expected_rate_rps": 10.0, "pool_kinds": ["cpu"], "precisions": ["fp32"],
            **extra}


def _start_router(start_service: ServiceStarter, tmp_path: Path, **settings: str) -> ServiceProcess:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump(FLEET))
    env = start_service.env("inference-router", extra_env={
        "OPML_INFERENCE_ROUTER_FLEET": str(fleet), "OPML_INFERENCE_ROUTER_WORKER_THREADS_PER_REPLICA": "1",
        **{f"OPML_INFERENCE_ROUTER_{name.upper()}": value for name, value in settings.items()}})
    return start_service("inference-router", env=env)


INVALID, TOO_LARGE_FOR_GRPC = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED


def _refused(stub: service_pb2_grpc.GRPCInferenceServiceStub, request: pb.ModelInferRequest | bytes,
             code: grpc.StatusCode = INVALID) -> str:
    """The error message (of status ``code``) the router answers ``request`` with (bytes are sent as they are)."""
    call = stub.ModelInfer if isinstance(request, pb.ModelInferRequest) else stub.raw_infer
    with pytest.raises(grpc.RpcError) as caught:
        call(request, timeout=120, metadata=AUTH)
    assert caught.value.code() == code, caught.value.details()
    return caught.value.details()


def _bytes_bomb(size: int = 63_000_000) -> pb.ModelInferRequest:
    """One declared BYTES element, ``size`` bytes (63 MB) of zero-length prefixes after it."""
    request = pb.ModelInferRequest(model_name="echo")
    request.inputs.add(name="text", datatype="BYTES", shape=[1, 1])
    request.raw_input_contents.append(b"\0\0\0\0" * (size // 4))
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


def _deploy(router: ServiceProcess, tmp_path: Path, echo: dict | None = None) -> None:
    """Refuses the two YAML attacks, then deploys ``mlp`` and ``echo`` (default config: :func:`echo_config`)
    on the one worker."""
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
        client.deploy(model_dir=str(write_model_dir(tmp_path / "echo", echo or echo_config(), echo_model())))


def _channel(router: ServiceProcess) -> grpc.Channel:
    return grpc.insecure_channel(router.target, options=[("grpc.max_send_message_length", 64 << 20),
                                                         ("grpc.max_receive_message_length", 64 << 20)])


def _stub(channel: grpc.Channel) -> service_pb2_grpc.GRPCInferenceServiceStub:
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    stub.raw_infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")  # bytes as they are
    return stub


# The attacker runs in a process of its own: in the measuring process its 63 MB copies into gRPC (made
# holding the GIL) would stall the measuring thread and be counted against the router. One line per
# attack, its status code: the parent counts them and checks each.
_ATTACKER = """
import os, sys, grpc
bombs = [(open(path, "rb").read(), code) for path, code in (arg.split("=") for arg in sys.argv[2:])]
channel = grpc.insecure_channel(sys.argv[1], options=[("grpc.max_send_message_length", 64 << 20)])
call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
auth = (("authorization", "Bearer " + os.environ["ATTACK_TOKEN"]),)
for n in range(1 << 30):
    data, code = bombs[n % len(bombs)]
    try:
        call(data, timeout=120, metadata=auth)
        print(code, "OK", flush=True)
    except grpc.RpcError as error:
        print(code, error.code().name, flush=True)
"""


def _p99_ratio(stub: service_pb2_grpc.GRPCInferenceServiceStub, router: ServiceProcess, tmp_path: Path,
               bombs: list[tuple[pb.ModelInferRequest | bytes, grpc.StatusCode]]) -> float:
    """mlp's p99 while ``bombs`` (each with the status it is refused with) are sent in turn beside it
    by another process, over its p99 alone (same router, same test)."""
    args = []
    for index, (bomb, code) in enumerate(bombs):
        path = tmp_path / f"bomb-{index}.bin"
        path.write_bytes(bomb.SerializeToString() if isinstance(bomb, pb.ModelInferRequest) else bomb)
        args.append(f"{path}={code.name}")
    _latencies(stub, 50)  # warm-up
    baseline = _latencies(stub, 300)
    attacker = subprocess.Popen([sys.executable, "-c", _ATTACKER, router.target, *args], stdout=subprocess.PIPE,
                                env={**os.environ, "ATTACK_TOKEN": TOKENS["admin"]}, text=True)
    started, attacks, wrong = threading.Event(), [0], []

    def count() -> None:
        for line in attacker.stdout:  # type: ignore[union-attr]
            expected, got = line.split()
            if got != expected:
                wrong.append(line)
            attacks[0] += 1
            started.set()

    counter = threading.Thread(target=count, daemon=True)
    counter.start()
    try:
        assert started.wait(120), "the attacker answered nothing"
        attacked: list[float] = []
        while attacks[0] < 12 or len(attacked) < 300:  # enough of both for the comparison
            attacked += _latencies(stub, 20)
    finally:
        attacker.kill()
        attacker.wait(60)
        counter.join(60)
    assert not wrong, f"attacks answered otherwise than expected (expected, got): {wrong[:3]}"
    ratio = _p99(attacked) / _p99(baseline)
    print(f"mlp p99 alone {_p99(baseline) * 1e3:.2f} ms, beside {attacks[0]} attacks {_p99(attacked) * 1e3:.2f} ms "
          f"({ratio:.1f}x)")
    return ratio


def test_costly_inputs_are_refused_and_the_other_model_keeps_its_p99(start_service: ServiceStarter,
                                                                      tmp_path: Path) -> None:
    # The platform's message cap, and an echo that accepts it, so the 63 MB request reaches the worker.
    router = _start_router(start_service, tmp_path, grpc_max_receive_bytes=str(64 << 20))
    _deploy(router, tmp_path, echo_config(max_request_bytes=64 << 20))
    with _channel(router) as channel:
        stub = _stub(channel)
        echo = pb.ModelInferRequest(model_name="echo")
        echo.inputs.add(name="text", datatype="BYTES", shape=[1, 2])
        echo.raw_input_contents.append(b"\x02\0\0\0hi\x00\0\0\0")
        answer = stub.ModelInfer(echo, timeout=60, metadata=AUTH)
        assert [(o.name, list(o.shape)) for o in answer.outputs] == [("echo", [1, 2])]  # a well-formed one serves

        # Each attack, once, with the field named.
        forwarded = _worker_invalid_infers(router)
        assert "inputs[text]: BYTES contents hold 62999996 bytes after the 1 elements" in _refused(stub, _bytes_bomb())
        assert _worker_invalid_infers(router) == forwarded + 1  # refused by the worker, behind the router
        assert _refused(stub, _overflow()).startswith("inputs[text].shape: declares more elements than a tensor "
                                                      "may hold: the product of dims [4,4611686018427387904] "
                                                      "overflows int64")
        assert "more than 4096 top-level fields" in _refused(stub, _unknown_fields_bomb())
        # Before the bounds one such request stalled the router 6.9 s (a ratio near 700 here). What is left is
        # receiving a 62 MiB message (grpc.aio holds the router's event loop ~100-200 ms turning it into bytes,
        # ~35x here), which the router's own 16 MiB cap, raised for this test, bounds (the next test): hence
        # the generous factor.
        assert _p99_ratio(stub, router, tmp_path, [(_unknown_fields_bomb(), INVALID), (_overflow(), INVALID)]) < 100


def _metrics(router: ServiceProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The router's /metrics (the workers' families included) as (name, labels) -> value."""
    text = scrape_router(router.env["OPML_INFERENCE_ROUTER_METRICS_PORT"])
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value for sample in samples(text)}


def _worker_invalid_infers(router: ServiceProcess) -> float:
    """ModelInfer calls the workers answered INVALID_ARGUMENT: each one a request the router forwarded."""
    return sum(value for (name, labels), value in _metrics(router).items()
               if name == "opml_inference_router_worker_uds_requests_total"
               and ("method", "ModelInfer") in labels and ("code", "INVALID_ARGUMENT") in labels)


def _refused_by_router(router: ServiceProcess, model: str) -> float:
    """The model's requests the router answered INVALID_ARGUMENT (itself, or passing on a worker's)."""
    return sum(value for (name, labels), value in _metrics(router).items()
               if name == "opml_inference_router_requests_total"
               and ("model", model) in labels and ("code", "INVALID_ARGUMENT") in labels)


def _padded_mlp(size: int) -> bytes:
    """A well-formed mlp request grown to ``size`` bytes by one unknown length-delimited field (15)."""
    head = encode_request("mlp", {"features": np.ones((1, 16), np.float32)}).SerializeToString()
    pad = size - len(head) - 5
    return head + b"\x7a" + bytes([0x80 | (pad & 0x7F), 0x80 | (pad >> 7 & 0x7F), 0x80 | (pad >> 14 & 0x7F),
                                     pad >> 21]) + b"\0" * pad


def test_a_stream_of_63_mb_bytes_requests_leaves_the_other_model_p99(start_service: ServiceStarter,
                                                                     tmp_path: Path) -> None:
    router = _start_router(start_service, tmp_path)  # as shipped: 16 MiB gRPC cap, 4 MiB for a BYTES model
    _deploy(router, tmp_path)
    with _channel(router) as channel:
        stub = _stub(channel)
        forwarded = _worker_invalid_infers(router)
        # Over the gRPC cap: refused by gRPC as the message's length arrives, never assembled.
        assert "larger than max (63000030 vs. 16777216)" in _refused(stub, _bytes_bomb(), TOO_LARGE_FOR_GRPC)
        # Under it, over the model's limit: refused by the router from the length alone, before any copy.
        assert _refused(stub, _bytes_bomb(5_000_000)) == (
            "request: is 5000030 bytes, more than model 'echo' accepts: 4194304 bytes "
            "(OPML_INFERENCE_ROUTER_MAX_REQUEST_BYTES, the default for a model whose inputs have no fixed size "
            "(text: BYTES or a -1 dim); set max_request_bytes in its config to change it)")
        # mlp's inputs are fixed: 32 (max batch) x 16 x 4 bytes + 64 KiB for the header.
        assert _refused(stub, _padded_mlp(67_585)).startswith(
            "request: is 67585 bytes, more than model 'mlp' accepts: 67584 bytes (max_batch_size 32 x its inputs' "
            "fixed dims x item size, 2048 bytes, + 65536 for the header)")
        stub.raw_infer(_padded_mlp(67_584), timeout=60, metadata=AUTH)  # at the limit: served
        assert (_refused_by_router(router, "echo"), _refused_by_router(router, "mlp")) == (1, 1)
        assert _worker_invalid_infers(router) == forwarded  # neither reached a worker

        # The stream, as the issue describes it, with requests over echo's limit mixed in. Before the caps
        # each 63 MB request was forwarded whole (~1 s end to end on 2 cores) and the ratio was ~200.
        bombs = [(_bytes_bomb(), TOO_LARGE_FOR_GRPC), (_bytes_bomb(5_000_000), INVALID)]
        assert _p99_ratio(stub, router, tmp_path, bombs) < 25
