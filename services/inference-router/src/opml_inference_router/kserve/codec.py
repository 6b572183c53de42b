"""numpy <-> Open Inference Protocol (KServe v2) messages, for the worker and for clients of it.

Requests may carry each tensor as ``raw_input_contents`` (what tritonclient sends: little-endian,
row-major bytes; BYTES elements each prefixed by their 4-byte length) or as typed ``contents``;
responses always use ``raw_output_contents``, which every v2 client reads and which costs no
per-element conversion. Raw tensors are decoded without a copy (``np.frombuffer``).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from opml_common.errors import InvalidArgument, brief
from opml_inference_router.kserve.datatypes import BY_KSERVE, DATATYPES, Datatype, of_array
from opml_inference_router.kserve.validation import (
    MAX_BYTES_ELEMENTS,
    MAX_ELEMENTS,
    check_input,
    check_input_names,
    check_output_names,
    describe,
    element_count,
    tensor_field,
)
from opml_inference_router.placement.config import ModelConfig


def serialize_bytes(array: np.ndarray) -> bytes:
    """BYTES tensor -> the protocol's raw form: each element's 4-byte little-endian length, then it."""
    parts = []
    for item in array.reshape(-1):
        data = item.encode() if isinstance(item, str) else bytes(item)
        parts.append(struct.pack("<I", len(data)))
        parts.append(data)
    return b"".join(parts)


def deserialize_bytes(raw: bytes, count: int, field: str) -> np.ndarray:
    """The protocol's raw BYTES form -> a flat object array of ``count`` bytes elements.

    The work is bounded by ``count``, not by the buffer: a buffer too small to hold ``count``
    length prefixes is refused before the walk, and the walk stops at element ``count``, so a
    declared shape of 1 with 63 MB of empty elements costs one element, not 16 million.

    Raises:
        InvalidArgument: the buffer does not hold exactly ``count`` length-prefixed elements.
    """
    size = len(raw)
    if count * 4 > size:
        raise InvalidArgument(field, f"BYTES contents hold {size} bytes, too few for the {count} elements the "
                                     f"shape needs (each has a 4-byte length prefix)")
    items: list[bytes] = []
    append = items.append
    unpack = _LENGTH.unpack_from
    offset = 0
    for index in range(count):
        if offset + 4 > size:
            raise InvalidArgument(field, f"BYTES contents end at byte {offset}, in element {index} of {count}")
        (length,) = unpack(raw, offset)
        offset += 4
        if offset + length > size:
            raise InvalidArgument(field, f"BYTES element {index} claims {length} bytes past the buffer's end")
        append(raw[offset:offset + length])
        offset += length
    if offset != size:
        raise InvalidArgument(field, f"BYTES contents hold {size - offset} bytes after the {count} elements the "
                                     "shape needs")
    array = np.empty(count, dtype=np.object_)
    array[:] = items
    return array


_LENGTH = struct.Struct("<I")


def _from_raw(raw: bytes, datatype: Datatype, shape: Sequence[int], field: str) -> np.ndarray:
    if datatype.config == "string":
        count = element_count(shape, field, max_elements=MAX_BYTES_ELEMENTS)
        return deserialize_bytes(raw, count, field).reshape(shape)
    count = element_count(shape, field)
    needed = count * datatype.numpy.itemsize
    if len(raw) != needed:
        raise InvalidArgument(field, f"raw contents hold {len(raw)} bytes, but {describe(datatype.kserve, shape)} "
                                     f"needs {needed}")
    return np.frombuffer(raw, dtype=datatype.numpy).reshape(shape)


def _from_contents(contents: pb.InferTensorContents, datatype: Datatype, shape: Sequence[int],
                   field: str) -> np.ndarray:
    if datatype.contents_field is None:
        raise InvalidArgument(field, f"{datatype.kserve} tensors must be sent as raw_input_contents")
    values = getattr(contents, datatype.contents_field)
    count = element_count(shape, field,
                          max_elements=MAX_BYTES_ELEMENTS if datatype.config == "string" else MAX_ELEMENTS)
    if len(values) != count:
        raise InvalidArgument(field, f"contents.{datatype.contents_field} holds {len(values)} values, but "
                                     f"{describe(datatype.kserve, shape)} needs {count}")
    if datatype.config == "string":
        array = np.empty(count, dtype=np.object_)
        array[:] = list(values)
        return array.reshape(shape)
    return np.asarray(values, dtype=datatype.numpy).reshape(shape)


def decode_inputs(request: pb.ModelInferRequest, config: ModelConfig, *, max_batch: int) -> dict[str, np.ndarray]:
    """The request's input tensors as arrays, each checked against ``config`` (names, datatype, shape,
    batch size <= ``max_batch``, byte counts); every input shares one batch size.

    Raises:
        InvalidArgument: naming the bad input (``inputs[image]``) with the expected and the received form.
    """
    specs = check_input_names([tensor.name for tensor in request.inputs], config)
    if request.outputs:
        check_output_names([output.name for output in request.outputs], config)
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidArgument("raw_input_contents", f"holds {len(raw)} tensors, but the request has "
                                                    f"{len(request.inputs)} inputs; send all inputs raw or none")
    arrays: dict[str, np.ndarray] = {}
    batch: int | None = None
    for index, tensor in enumerate(request.inputs):
        field = f"inputs[{tensor.name}]"
        shape = list(tensor.shape)
        check_input(specs[tensor.name], config, tensor.datatype, shape, max_batch=max_batch)
        if config.max_batch_size > 0:
            if batch is not None and shape[0] != batch:
                raise InvalidArgument(field, f"batch size {shape[0]} differs from the other inputs' {batch}; "
                                             "every input must have the same first dimension")
            batch = shape[0]
        datatype = BY_KSERVE[tensor.datatype]
        arrays[tensor.name] = (_from_raw(raw[index], datatype, shape, field) if raw
                               else _from_contents(tensor.contents, datatype, shape, field))
    return arrays


def encode_response(request: pb.ModelInferRequest, config: ModelConfig, version: int,
                    outputs: Mapping[str, np.ndarray]) -> pb.ModelInferResponse:
    """The reply to ``request``: the outputs it asked for (all of them when it named none), as raw bytes."""
    wanted = [output.name for output in request.outputs] or [spec.name for spec in config.outputs]
    response = pb.ModelInferResponse(model_name=config.name, model_version=str(version), id=request.id)
    types = {spec.name: DATATYPES[spec.data_type] for spec in config.outputs}
    for name in wanted:
        array = outputs[name]
        datatype = types[name]
        response.outputs.add(name=name, datatype=datatype.kserve, shape=array.shape)
        response.raw_output_contents.append(
            serialize_bytes(array) if datatype.config == "string" else np.ascontiguousarray(array).tobytes())
    return response


def encode_request(model: str, inputs: Mapping[str, np.ndarray], *, version: str = "", request_id: str = "",
                   outputs: Sequence[str] = ()) -> pb.ModelInferRequest:
    """A ModelInferRequest with raw contents (what tritonclient builds), for clients without tritonclient's
    client objects: the router forwarding a call, benches driving grpc.aio directly."""
    request = pb.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    for name, array in inputs.items():
        datatype = of_array(array)
        request.inputs.add(name=name, datatype=datatype.kserve, shape=array.shape)
        request.raw_input_contents.append(
            serialize_bytes(array) if datatype.config == "string" else np.ascontiguousarray(array).tobytes())
    for name in outputs:
        request.outputs.add(name=name)
    return request


def decode_response(response: pb.ModelInferResponse) -> dict[str, np.ndarray]:
    """A ModelInferResponse's outputs as arrays (raw or typed contents).

    Raises:
        InvalidArgument: an output's datatype is unknown or its contents do not match its shape.
    """
    arrays: dict[str, np.ndarray] = {}
    raw = response.raw_output_contents
    if raw and len(raw) != len(response.outputs):
        raise InvalidArgument("raw_output_contents", f"holds {len(raw)} tensors, but the response has "
                                                     f"{len(response.outputs)} outputs")
    for index, tensor in enumerate(response.outputs):
        field = f"outputs[{tensor_field(tensor.name)}]"
        datatype = BY_KSERVE.get(tensor.datatype)
        if datatype is None:
            raise InvalidArgument(field, f"datatype must be one of {', '.join(BY_KSERVE)}, "
                                         f"but got {brief(tensor.datatype)}")
        shape = list(tensor.shape)
        arrays[tensor.name] = (_from_raw(raw[index], datatype, shape, field) if raw
                               else _from_contents(tensor.contents, datatype, shape, field))
    return arrays
