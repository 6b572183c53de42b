"""numpy <-> Open Inference Protocol (KServe v2) tensors: the one codec the router and the scorer share.

Requests may carry each tensor as ``raw_input_contents`` (what tritonclient sends: little-endian,
row-major bytes; BYTES elements each prefixed by their 4-byte length) or as typed ``contents``;
responses written by the platform use ``raw_output_contents``. Raw tensors are decoded without a
copy (``np.frombuffer``). Every decode bounds its work by the tensor's declared shape before it
touches the bytes, so a hostile or corrupt message costs O(rank) to refuse.

Nothing here knows a model's config: the router checks a request against its ModelConfig
(``opml_inference_router.kserve.validation``) before it decodes with these functions; the
monitoring-scorer decodes what was logged as it is (:func:`decode_request`, :func:`decode_response`).

Needs the ``kserve`` extra of opml-common (numpy, ml_dtypes, tritonclient's generated stubs).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import ml_dtypes
import numpy as np
from tritonclient.grpc import service_pb2 as pb

from opml_common.errors import InvalidArgument, brief


@dataclass(frozen=True)
class Datatype:
    """One element type under its four names. ``contents_field`` is the ``InferTensorContents`` field
    that carries it when a client sends typed contents instead of raw bytes (None: raw only)."""

    config: str
    kserve: str
    numpy: np.dtype
    onnx: str
    contents_field: str | None


_TABLE = (
    Datatype("bool", "BOOL", np.dtype(np.bool_), "tensor(bool)", "bool_contents"),
    Datatype("uint8", "UINT8", np.dtype(np.uint8), "tensor(uint8)", "uint_contents"),
    Datatype("uint16", "UINT16", np.dtype(np.uint16), "tensor(uint16)", "uint_contents"),
    Datatype("uint32", "UINT32", np.dtype(np.uint32), "tensor(uint32)", "uint_contents"),
    Datatype("uint64", "UINT64", np.dtype(np.uint64), "tensor(uint64)", "uint64_contents"),
    Datatype("int8", "INT8", np.dtype(np.int8), "tensor(int8)", "int_contents"),
    Datatype("int16", "INT16", np.dtype(np.int16), "tensor(int16)", "int_contents"),
    Datatype("int32", "INT32", np.dtype(np.int32), "tensor(int32)", "int_contents"),
    Datatype("int64", "INT64", np.dtype(np.int64), "tensor(int64)", "int64_contents"),
    Datatype("fp16", "FP16", np.dtype(np.float16), "tensor(float16)", None),
    Datatype("bf16", "BF16", np.dtype(ml_dtypes.bfloat16), "tensor(bfloat16)", None),
    Datatype("fp32", "FP32", np.dtype(np.float32), "tensor(float)", "fp32_contents"),
    Datatype("fp64", "FP64", np.dtype(np.float64), "tensor(double)", "fp64_contents"),
    Datatype("string", "BYTES", np.dtype(np.object_), "tensor(string)", "bytes_contents"),
)

DATATYPES: dict[str, Datatype] = {d.config: d for d in _TABLE}
"""By ModelConfig name (``fp32``)."""
BY_KSERVE: dict[str, Datatype] = {d.kserve: d for d in _TABLE}
"""By KServe v2 wire name (``FP32``)."""
BY_ONNX: dict[str, Datatype] = {d.onnx: d for d in _TABLE}
"""By ONNX Runtime type string (``tensor(float)``)."""
BY_NUMPY: dict[np.dtype, Datatype] = {d.numpy: d for d in _TABLE}
"""By numpy dtype (object arrays are BYTES)."""


def kserve_name(config_type: str) -> str:
    """``fp32`` -> ``FP32``."""
    return DATATYPES[config_type].kserve


def of_array(array: np.ndarray) -> Datatype:
    """The datatype of a numpy array; bytes/str arrays are BYTES.

    Raises:
        KeyError: the dtype has no KServe v2 equivalent (complex numbers, datetimes).
    """
    if array.dtype.kind in "SU":
        return DATATYPES["string"]
    return BY_NUMPY[array.dtype]


MAX_ELEMENTS = 1 << 28
"""Most elements one tensor may declare (its shape's product): 1 GiB of FP32, past any message."""
MAX_BYTES_ELEMENTS = 1 << 22
"""Most elements one BYTES tensor may declare: each is a Python object decoded one by one."""
_SHOWN_DIMS = 8
_SHOWN_NAME = 64


def describe(datatype: str, shape: Sequence[int]) -> str:
    """``FP32 [-1,3,224,224]``: the form of a tensor as messages show it (at most 8 dims of a
    longer shape, and its rank; a datatype cut to 64 characters)."""
    dims = ",".join(str(d) for d in shape[:_SHOWN_DIMS])
    if len(shape) > _SHOWN_DIMS:
        dims += f",... ({len(shape)} dims)"
    return f"{datatype if len(datatype) <= _SHOWN_NAME else brief(datatype, _SHOWN_NAME)} [{dims}]"


def tensor_field(name: str) -> str:
    """``inputs[<name>]`` with a name cut to 64 characters: a field path stays short whatever came."""
    return name if len(name) <= _SHOWN_NAME else name[:_SHOWN_NAME - 3] + "..."


def element_count(shape: Sequence[int], field: str, *, max_elements: int = MAX_ELEMENTS) -> int:
    """The number of elements ``shape`` declares, checked before anything is decoded: O(rank),
    never an int64 overflow (the product stops as soon as it passes ``max_elements``).

    Raises:
        InvalidArgument: field ``<field>.shape``: a dim < 0, or a product that overflows int64 or
            exceeds ``max_elements``.
    """
    for index, dim in enumerate(shape):
        if dim < 0:
            raise InvalidArgument(f"{field}.shape", f"dims must be >= 0, but dim {index} is {dim}")
    if 0 in shape:
        return 0
    count = 1
    for dim in shape:
        count *= dim
        if count > max_elements:
            overflow = "overflows int64" if _product_overflows(shape) else f"exceeds {max_elements}"
            raise InvalidArgument(f"{field}.shape", f"declares more elements than a tensor may hold: the product "
                                                    f"of {describe('dims', shape)} {overflow}")
    return count


def _product_overflows(shape: Sequence[int]) -> bool:
    count = 1
    for dim in shape:
        count *= dim
        if count > (1 << 63) - 1:
            return True
    return False


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
    items: list[bytes] = []
    _bytes_items(raw, count, field, items)
    array = np.empty(count, dtype=np.object_)
    array[:] = items
    return array


def _bytes_items(raw: bytes, count: int, field: str, items: list[bytes]) -> None:
    """Appends the ``count`` length-prefixed elements of ``raw`` to ``items`` (see :func:`deserialize_bytes`)."""
    size = len(raw)
    if count * 4 > size:
        raise InvalidArgument(field, f"BYTES contents hold {size} bytes, too few for the {count} elements the "
                                     f"shape needs (each has a 4-byte length prefix)")
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


_LENGTH = struct.Struct("<I")


def from_raw(raw: bytes, datatype: Datatype, shape: Sequence[int], field: str) -> np.ndarray:
    """One tensor's raw bytes as an array of ``shape`` (no copy for numeric types).

    Raises:
        InvalidArgument: ``field``: the shape is out of bounds or the byte count does not match it.
    """
    if datatype.config == "string":
        count = element_count(shape, field, max_elements=MAX_BYTES_ELEMENTS)
        return deserialize_bytes(raw, count, field).reshape(shape)
    count = element_count(shape, field)
    needed = count * datatype.numpy.itemsize
    if len(raw) != needed:
        raise InvalidArgument(field, f"raw contents hold {len(raw)} bytes, but {describe(datatype.kserve, shape)} "
                                     f"needs {needed}")
    return np.frombuffer(raw, dtype=datatype.numpy).reshape(shape)


def from_contents(contents: pb.InferTensorContents, datatype: Datatype, shape: Sequence[int],
                  field: str) -> np.ndarray:
    """One tensor's typed contents as an array of ``shape``.

    Raises:
        InvalidArgument: ``field``: the datatype has no typed field, or the value count does not match.
    """
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
    try:
        return np.asarray(values, dtype=datatype.numpy).reshape(shape)
    except OverflowError:  # an INT8 value sent in the int32 field, a UINT16 one in uint32: numpy refuses
        raise InvalidArgument(field, f"contents.{datatype.contents_field} holds a value out of range for "
                                     f"{datatype.kserve}") from None


def _decode_tensors(tensors, raw: Sequence[bytes], kind: str, message: str) -> dict[str, np.ndarray]:
    if raw and len(raw) != len(tensors):
        raise InvalidArgument(f"raw_{kind}_contents", f"holds {len(raw)} tensors, but the {message} has "
                                                      f"{len(tensors)} {kind}s")
    arrays: dict[str, np.ndarray] = {}
    for index, tensor in enumerate(tensors):
        field = f"{kind}s[{tensor_field(tensor.name)}]"
        datatype = BY_KSERVE.get(tensor.datatype)
        if datatype is None:
            raise InvalidArgument(field, f"datatype must be one of {', '.join(BY_KSERVE)}, "
                                         f"but got {brief(tensor.datatype)}")
        shape = list(tensor.shape)
        arrays[tensor.name] = (from_raw(raw[index], datatype, shape, field) if raw
                               else from_contents(tensor.contents, datatype, shape, field))
    return arrays


def decode_response(response: pb.ModelInferResponse) -> dict[str, np.ndarray]:
    """A ModelInferResponse's outputs as arrays (raw or typed contents).

    Raises:
        InvalidArgument: an output's datatype is unknown or its contents do not match its shape.
    """
    return _decode_tensors(response.outputs, response.raw_output_contents, "output", "response")


def decode_request(request: pb.ModelInferRequest) -> dict[str, np.ndarray]:
    """A ModelInferRequest's inputs as arrays, each by the datatype and shape it declares (no model
    config: what a prediction log recorded, decoded as it is).

    Raises:
        InvalidArgument: an input's datatype is unknown or its contents do not match its shape.
    """
    return _decode_tensors(request.inputs, request.raw_input_contents, "input", "request")


def decode_stacked(messages: Sequence[pb.ModelInferRequest] | Sequence[pb.ModelInferResponse],
                   ) -> tuple[dict[str, np.ndarray], list[int]]:
    """The tensors of many requests (or many responses) of one layout, stacked on their first (batch)
    dim, and each message's batch size: what :func:`decode_request` of each and ``np.concatenate``
    give, in one numpy call per tensor instead of one per message (a log of one-row requests is
    decoded as one tensor, not as thousands). Raw contents only, as the platform logs them.

    Raises:
        InvalidArgument: ``[i].inputs[x]`` (or ``outputs``): message i's tensors differ from message
            0's in name, datatype or dims past the first, carry typed contents, disagree on the batch
            size, or do not match their shape. A caller that must know which messages are bad
            decodes them one by one.
    """
    if not messages:
        return {}, []
    kind = "input" if isinstance(messages[0], pb.ModelInferRequest) else "output"
    tensors_of = (lambda m: (m.inputs, m.raw_input_contents)) if kind == "input" else (
        lambda m: (m.outputs, m.raw_output_contents))
    first, _ = tensors_of(messages[0])
    layout = []
    for tensor in first:
        field = f"[0].{kind}s[{tensor_field(tensor.name)}]"
        datatype = BY_KSERVE.get(tensor.datatype)
        if datatype is None:
            raise InvalidArgument(field, f"datatype must be one of {', '.join(BY_KSERVE)}, "
                                         f"but got {brief(tensor.datatype)}")
        if not tensor.shape:
            raise InvalidArgument(f"{field}.shape", "is a scalar; stacked tensors have a batch dimension")
        layout.append((tensor.name, tensor.datatype, list(tensor.shape[1:]), datatype))
    width = len(layout)
    columns: list[list[bytes]] = [[] for _ in layout]
    sizes: list[int] = []
    for index, message in enumerate(messages):
        tensors, raw = tensors_of(message)
        if len(tensors) != width or len(raw) != width:
            raise InvalidArgument(f"[{index}].raw_{kind}_contents",
                                  f"holds {len(raw)} raw tensors of {len(tensors)} {kind}s, but message 0 has "
                                  f"{width} of each")
        size = None
        for tensor, (name, datatype, rest, _) in zip(tensors, layout, strict=True):
            shape = tensor.shape
            if not shape or tensor.name != name or tensor.datatype != datatype or shape[1:] != rest:
                raise InvalidArgument(f"[{index}].{kind}s[{tensor_field(tensor.name)}]",
                                      f"is {describe(tensor.datatype, shape)}, but message 0's {name[:64]!r} is "
                                      f"{describe(datatype, [-1, *rest])}")
            if size is None:
                size = shape[0]
            elif shape[0] != size:
                raise InvalidArgument(f"[{index}].{kind}s", f"disagree on the batch size: {size} and {shape[0]}")
        sizes.append(size or 0)
        for column, data in zip(columns, raw, strict=True):
            column.append(data)
    if sizes and min(sizes) < 0:
        index = next(i for i, n in enumerate(sizes) if n < 0)
        raise InvalidArgument(f"[{index}].{kind}s", f"dims must be >= 0, but the batch dim is {sizes[index]}")
    arrays: dict[str, np.ndarray] = {}
    total = sum(sizes)
    for column, (name, _, rest, datatype) in zip(columns, layout, strict=True):
        field = f"{kind}s[{tensor_field(name)}]"
        shape = [total, *rest]
        if datatype.config == "string":
            element_count(shape, field, max_elements=MAX_BYTES_ELEMENTS)
            per_row = element_count(rest, field) if rest else 1
            items: list[bytes] = []
            for index, (data, size) in enumerate(zip(column, sizes, strict=True)):
                _bytes_items(data, size * per_row, f"[{index}].{field}", items)
            array = np.empty(len(items), dtype=np.object_)
            array[:] = items
            arrays[name] = array.reshape(shape)
            continue
        count = element_count(shape, field)
        row_bytes = (element_count(rest, field) if rest else 1) * datatype.numpy.itemsize
        bad = next((i for i, (data, size) in enumerate(zip(column, sizes, strict=True))
                    if len(data) != size * row_bytes), None)
        if bad is not None:
            raise InvalidArgument(f"[{bad}].{field}", f"raw contents hold {len(column[bad])} bytes, but "
                                                      f"{describe(datatype.kserve, [sizes[bad], *rest])} needs "
                                                      f"{sizes[bad] * row_bytes}")
        arrays[name] = np.frombuffer(b"".join(column), dtype=datatype.numpy, count=count).reshape(shape)
    return arrays, sizes


def encode_request(model: str, inputs: Mapping[str, np.ndarray], *, version: str = "", request_id: str = "",
                   outputs: Sequence[str] = ()) -> pb.ModelInferRequest:
    """A ModelInferRequest with raw contents (what tritonclient builds), for clients without tritonclient's
    client objects: the router forwarding a call, benches driving grpc.aio directly, event producers."""
    request = pb.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    for name, array in inputs.items():
        datatype = of_array(array)
        request.inputs.add(name=name, datatype=datatype.kserve, shape=array.shape)
        request.raw_input_contents.append(
            serialize_bytes(array) if datatype.config == "string" else np.ascontiguousarray(array).tobytes())
    for name in outputs:
        request.outputs.add(name=name)
    return request


def encode_outputs(response: pb.ModelInferResponse, outputs: Mapping[str, np.ndarray]) -> pb.ModelInferResponse:
    """Appends ``outputs`` to ``response`` as raw tensors (each by its array's datatype) and returns it."""
    for name, array in outputs.items():
        datatype = of_array(array)
        response.outputs.add(name=name, datatype=datatype.kserve, shape=array.shape)
        response.raw_output_contents.append(
            serialize_bytes(array) if datatype.config == "string" else np.ascontiguousarray(array).tobytes())
    return response
