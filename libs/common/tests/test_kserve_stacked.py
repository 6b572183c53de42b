"""decode_stacked: many requests (or responses) of one layout decoded as stacked tensors, the same
arrays as decoding each; a message that breaks the layout or its shape is named by its index."""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from opml_common.errors import InvalidArgument
from opml_common.kserve_codec import decode_request, decode_response, decode_stacked, encode_outputs, encode_request


def _requests(sizes: list[int]) -> list[pb.ModelInferRequest]:
    rng = np.random.default_rng(0)
    out = []
    for n in sizes:
        words = np.array([[f"w{i}".encode(), b""] for i in range(n)], dtype=object).reshape(n, 2)
        out.append(encode_request("m", {"x": rng.normal(size=(n, 3)).astype(np.float32), "w": words,
                                        "i": np.arange(n, dtype=np.int64)}))
    return out


def test_stacked_equals_each_decoded_and_concatenated() -> None:
    requests = _requests([1, 3, 0, 2])
    arrays, sizes = decode_stacked(requests)
    assert sizes == [1, 3, 0, 2]
    each = [decode_request(r) for r in requests]
    for name in ("x", "w", "i"):
        expected = np.concatenate([e[name] for e in each])
        assert arrays[name].dtype == expected.dtype and arrays[name].shape == expected.shape
        assert arrays[name].tolist() == expected.tolist()
    responses = [encode_outputs(pb.ModelInferResponse(), {"p": np.full((n, 2), n, np.float32)}) for n in (2, 1)]
    stacked, sizes = decode_stacked(responses)
    assert sizes == [2, 1]
    assert stacked["p"].tolist() == np.concatenate([decode_response(r)["p"] for r in responses]).tolist()


def test_a_message_of_another_layout_or_a_wrong_length_is_named_by_its_index() -> None:
    requests = _requests([1, 1, 1])
    other = encode_request("m", {"x": np.zeros((1, 4), np.float32), "w": np.array([[b"a", b"b"]], dtype=object),
                                 "i": np.zeros(1, np.int64)})
    with pytest.raises(InvalidArgument) as caught:
        decode_stacked([*requests, other])
    assert caught.value.violations[0][0] == "[3].inputs[x]"
    short = _requests([2])[0]
    short.raw_input_contents[0] = short.raw_input_contents[0][:-4]
    with pytest.raises(InvalidArgument) as caught:
        decode_stacked([requests[0], short])
    assert caught.value.violations[0][0] == "[1].inputs[x]"
    bad_bytes = _requests([1])[0]
    bad_bytes.raw_input_contents[1] = bad_bytes.raw_input_contents[1] + b"\0"
    with pytest.raises(InvalidArgument) as caught:
        decode_stacked([requests[0], bad_bytes])
    assert caught.value.violations[0][0] == "[1].inputs[w]"
    typed = pb.ModelInferRequest(model_name="m")
    typed.inputs.add(name="x", datatype="FP32", shape=[1, 3]).contents.fp32_contents.extend([1, 2, 3])
    with pytest.raises(InvalidArgument, match="raw tensors"):
        decode_stacked([typed])
