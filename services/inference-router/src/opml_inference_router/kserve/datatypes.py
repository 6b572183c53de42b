"""One table for tensor element types: ModelConfig names, KServe v2 names, numpy and ONNX types.

The model config speaks Triton's ``DataType`` names in lower case (``fp32``), the wire speaks the
Open Inference Protocol's (``FP32``), numpy and ONNX Runtime have their own; every conversion in the
router goes through :data:`DATATYPES` so the four never drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np


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
