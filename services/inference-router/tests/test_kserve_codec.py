"""The KServe v2 tensor codec and request validation against a ModelConfig (pure logic, no server)."""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from opml_common.errors import InvalidArgument
from opml_inference_router.kserve import (
    decode_inputs,
    decode_response,
    deserialize_bytes,
    encode_request,
    encode_response,
    serialize_bytes,
)
from opml_inference_router_contract.model_config import ModelConfig

IMAGE_MODEL = ModelConfig.from_dict({
    "name": "defect-classifier", "max_batch_size": 32,
    "inputs": [{"name": "image", "data_type": "fp32", "dims": [3, 224, 224]},
               {"name": "line", "data_type": "string", "dims": [1]}],
    "outputs": [{"name": "defect_scores", "data_type": "fp32", "dims": [4]},
                {"name": "label", "data_type": "int64", "dims": [1]}],
    "slo": {"p99_ms": 25}, "expected_rate_rps": 10, "pool_kinds": ["cpu"],
})
UNBATCHED = ModelConfig.from_dict({
    "name": "scalar", "max_batch_size": 0,
    "inputs": [{"name": "x", "data_type": "int32", "dims": [2, -1]}],
    "outputs": [{"name": "y", "data_type": "bool", "dims": [2]}],
    "slo": {"p99_ms": 25}, "expected_rate_rps": 10, "pool_kinds": ["cpu"],
})


def image_inputs(batch: int = 2) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"image": rng.standard_normal((batch, 3, 224, 224)).astype(np.float32),
            "line": np.array([[b"line-a"], ["línea-b".encode()]][:batch], dtype=np.object_)}


def test_raw_round_trip_keeps_values_and_shapes() -> None:
    sent = image_inputs()
    decoded = decode_inputs(encode_request("defect-classifier", sent), IMAGE_MODEL, max_batch=32)
    np.testing.assert_array_equal(decoded["image"], sent["image"])
    assert decoded["line"].tolist() == sent["line"].tolist()


def test_bytes_encoding_matches_tritonclient() -> None:
    array = np.array([b"a", b"", "ü".encode(), b"\x00z"], dtype=np.object_)
    assert serialize_bytes(array) == serialize_byte_tensor(array).item()
    assert deserialize_bytes(serialize_bytes(array), 4, "x").tolist() == deserialize_bytes_tensor(
        serialize_byte_tensor(array).item()).tolist()


def test_typed_contents_are_decoded() -> None:
    request = pb.ModelInferRequest(model_name="scalar")
    tensor = request.inputs.add(name="x", datatype="INT32", shape=[2, 3])
    tensor.contents.int_contents.extend([1, 2, 3, 4, 5, 6])
    decoded = decode_inputs(request, UNBATCHED, max_batch=1)
    np.testing.assert_array_equal(decoded["x"], np.arange(1, 7, dtype=np.int32).reshape(2, 3))
    assert decoded["x"].dtype == np.int32


def test_typed_contents_out_of_range_for_the_datatype_name_the_input() -> None:
    config = ModelConfig.from_dict({**UNBATCHED.model_dump(), "inputs": [
        {"name": "x", "data_type": "int8", "dims": [2, -1]}]})
    request = pb.ModelInferRequest(model_name="scalar")
    tensor = request.inputs.add(name="x", datatype="INT8", shape=[2, 1])
    tensor.contents.int_contents.extend([1, 1000])
    with pytest.raises(InvalidArgument) as caught:
        decode_inputs(request, config, max_batch=1)
    assert str(caught.value) == "inputs[x]: contents.int_contents holds a value out of range for INT8"


def test_wrong_datatype_names_the_input_and_the_expected_form() -> None:
    sent = image_inputs(1)
    sent["image"] = np.zeros((1, 3, 224, 224), dtype=np.int64)
    with pytest.raises(InvalidArgument) as caught:
        decode_inputs(encode_request("defect-classifier", sent), IMAGE_MODEL, max_batch=32)
    assert str(caught.value) == "inputs[image]: expected FP32 [-1,3,224,224], got INT64 [1,3,224,224]"


@pytest.mark.parametrize(("shape", "message"), [
    ((1, 3, 224), "inputs[image]: expected FP32 [-1,3,224,224], got FP32 [1,3,224]"),
    ((1, 3, 224, 225), "inputs[image]: expected FP32 [-1,3,224,224], got FP32 [1,3,224,225]"),
])
def test_wrong_shape_is_refused(shape: tuple[int, ...], message: str) -> None:
    sent = {"image": np.zeros(shape, np.float32), "line": np.array([[b"l"]], dtype=np.object_)}
    with pytest.raises(InvalidArgument, match=message.replace("[", r"\[").replace("]", r"\]")):
        decode_inputs(encode_request("defect-classifier", sent), IMAGE_MODEL, max_batch=32)


def test_batch_above_the_cap_is_refused() -> None:
    sent = {"image": np.zeros((9, 3, 224, 224), np.float32), "line": np.full((9, 1), b"l", dtype=np.object_)}
    with pytest.raises(InvalidArgument, match=r"inputs\[image\]: batch size must be <= 8"):
        decode_inputs(encode_request("defect-classifier", sent), IMAGE_MODEL, max_batch=8)


def test_unknown_missing_and_repeated_inputs_are_refused() -> None:
    sent = image_inputs(1)
    with pytest.raises(InvalidArgument, match=r"^inputs\[img\]: is not an input of model defect-classifier; "
                                              r"its inputs are image \(FP32 \[-1,3,224,224\]\)"):
        decode_inputs(encode_request("defect-classifier", {"img": sent["image"], "line": sent["line"]}),
                      IMAGE_MODEL, max_batch=32)
    with pytest.raises(InvalidArgument, match=r"^inputs: model defect-classifier needs input line \(BYTES \[-1,1\]\)"):
        decode_inputs(encode_request("defect-classifier", {"image": sent["image"]}), IMAGE_MODEL, max_batch=32)
    request = encode_request("defect-classifier", sent)
    request.inputs.add(name="image", datatype="FP32", shape=[1, 3, 224, 224])
    with pytest.raises(InvalidArgument, match=r"^inputs\[image\]: appears twice"):
        decode_inputs(request, IMAGE_MODEL, max_batch=32)


def test_inconsistent_contents_are_refused() -> None:
    request = encode_request("defect-classifier", image_inputs(1))
    request.raw_input_contents[0] = request.raw_input_contents[0][:-4]
    with pytest.raises(InvalidArgument, match=r"inputs\[image\]: raw contents hold 602108 bytes, but FP32 "
                                              r"\[1,3,224,224\] needs 602112"):
        decode_inputs(request, IMAGE_MODEL, max_batch=32)
    request = encode_request("defect-classifier", image_inputs(2))
    request.inputs[1].shape[0] = 1
    with pytest.raises(InvalidArgument, match=r"inputs\[line\]: batch size 1 differs from the other inputs' 2"):
        decode_inputs(request, IMAGE_MODEL, max_batch=32)
    request = encode_request("defect-classifier", image_inputs(1))
    del request.raw_input_contents[1]
    with pytest.raises(InvalidArgument, match=r"^raw_input_contents: holds 1 tensors, but the request has 2"):
        decode_inputs(request, IMAGE_MODEL, max_batch=32)


def test_unknown_requested_output_is_refused() -> None:
    request = encode_request("defect-classifier", image_inputs(1), outputs=["scores"])
    with pytest.raises(InvalidArgument, match=r"^outputs\[scores\]: is not an output of model defect-classifier"):
        decode_inputs(request, IMAGE_MODEL, max_batch=32)


def test_response_carries_the_requested_outputs_raw() -> None:
    outputs = {"defect_scores": np.arange(8, dtype=np.float32).reshape(2, 4),
               "label": np.array([[3], [1]], dtype=np.int64)}
    request = encode_request("defect-classifier", image_inputs(), request_id="r-1", outputs=["label"])
    response = encode_response(request, IMAGE_MODEL, 7, outputs)
    assert (response.model_name, response.model_version, response.id) == ("defect-classifier", "7", "r-1")
    assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [("label", "INT64", [2, 1])]
    np.testing.assert_array_equal(decode_response(response)["label"], outputs["label"])
    everything = decode_response(encode_response(encode_request("defect-classifier", image_inputs()),
                                                 IMAGE_MODEL, 1, outputs))
    assert sorted(everything) == ["defect_scores", "label"]
    np.testing.assert_array_equal(everything["defect_scores"], outputs["defect_scores"])


# -- bounds before work (issue 16, item 3) ------------------------------------------------------------

TEXT_MODEL = ModelConfig.from_dict({
    "name": "echo", "max_batch_size": 8,
    "inputs": [{"name": "text", "data_type": "string", "dims": [-1]}],
    "outputs": [{"name": "echo", "data_type": "string", "dims": [-1]}],
    "slo": {"p99_ms": 25}, "expected_rate_rps": 10, "pool_kinds": ["cpu"],
})


def _text_request(shape: list[int], raw: bytes) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="echo")
    request.inputs.add(name="text", datatype="BYTES", shape=shape)
    request.raw_input_contents.append(raw)
    return request


def test_a_bytes_buffer_past_the_declared_count_costs_one_element() -> None:
    bomb = _text_request([1, 1], b"\0\0\0\0" * 4_000_000)  # 16 MB of empty elements after the one declared
    with pytest.raises(InvalidArgument, match=r"^inputs\[text\]: BYTES contents hold 15999996 bytes after the 1 "):
        decode_inputs(bomb, TEXT_MODEL, max_batch=8)
    with pytest.raises(InvalidArgument, match=r"^inputs\[text\]: BYTES contents hold 4 bytes, too few for the 2 "):
        decode_inputs(_text_request([1, 2], b"\0\0\0\0"), TEXT_MODEL, max_batch=8)


@pytest.mark.parametrize(("shape", "rule"), [
    ([4, 1 << 62], r"the product of dims \[4,4611686018427387904\] overflows int64"),
    ([8, (1 << 63) - 1], r"overflows int64"),
    ([1, 1 << 30], r"exceeds 4194304"),
])
def test_a_shape_is_counted_before_anything_is_decoded(shape: list[int], rule: str) -> None:
    with pytest.raises(InvalidArgument, match=r"^inputs\[text\]\.shape: declares more elements .*" + rule) as caught:
        decode_inputs(_text_request(shape, b""), TEXT_MODEL, max_batch=8)
    assert caught.value.field == "inputs[text].shape"


def test_fixed_size_payloads_are_compared_exactly_and_negative_dims_refused() -> None:
    request = pb.ModelInferRequest(model_name="scalar")
    request.inputs.add(name="x", datatype="INT32", shape=[2, 1 << 40])
    request.raw_input_contents.append(b"\0" * 8)
    with pytest.raises(InvalidArgument, match=r"^inputs\[x\]\.shape: .* exceeds 268435456"):
        decode_inputs(request, UNBATCHED, max_batch=1)
    request.inputs[0].shape[1] = -3
    with pytest.raises(InvalidArgument, match=r"^inputs\[x\]: expected INT32 \[2,-1\], got INT32 \[2,-3\]"):
        decode_inputs(request, UNBATCHED, max_batch=1)


def test_error_fields_and_forms_stay_short_whatever_the_request_holds() -> None:
    request = encode_request("defect-classifier", image_inputs(1))
    request.inputs[0].name = "x" * 1_000_000
    with pytest.raises(InvalidArgument) as caught:
        decode_inputs(request, IMAGE_MODEL, max_batch=32)
    assert len(caught.value.field) < 80
    request = encode_request("defect-classifier", image_inputs(1))
    request.inputs[0].shape.extend([1] * 100_000)
    with pytest.raises(InvalidArgument, match=r"got FP32 \[1,3,224,224,1,1,1,1,\.\.\. \(100004 dims\)\]") as caught:
        decode_inputs(request, IMAGE_MODEL, max_batch=32)
    assert len(caught.value.message) < 200
