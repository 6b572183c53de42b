"""The Open Inference Protocol (KServe v2) on the wire: datatypes, request validation and the tensor codec.

The messages are tritonclient's generated ``tritonclient.grpc.service_pb2`` (package ``inference``),
not a copy of ours: protobuf refuses two files that define the same ``inference.*`` symbols in one
process, and clients import tritonclient beside our code (README, "Why tritonclient's stubs").
"""

from opml_inference_router.kserve.codec import (
    decode_inputs,
    decode_response,
    deserialize_bytes,
    encode_request,
    encode_response,
    serialize_bytes,
)
from opml_inference_router.kserve.datatypes import BY_KSERVE, BY_NUMPY, BY_ONNX, DATATYPES, Datatype, kserve_name
from opml_inference_router.kserve.validation import expected_form, expected_shape

__all__ = [
    "BY_KSERVE",
    "BY_NUMPY",
    "BY_ONNX",
    "DATATYPES",
    "Datatype",
    "decode_inputs",
    "decode_response",
    "deserialize_bytes",
    "encode_request",
    "encode_response",
    "expected_form",
    "expected_shape",
    "kserve_name",
    "serialize_bytes",
]
