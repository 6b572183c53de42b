"""numpy <-> Open Inference Protocol (KServe v2) messages checked against a model's config.

The tensor codec itself (raw and typed contents, BYTES framing, requests and responses decoded as
they are) is ``opml_common.kserve_codec``, shared with the monitoring-scorer; this module adds what
only the router knows: a request checked against its ModelConfig before its bytes are decoded, and a
response holding the outputs the config declares. Responses always use ``raw_output_contents``,
which every v2 client reads and which costs no per-element conversion.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from opml_common.errors import InvalidArgument
from opml_common.kserve_codec import (  # noqa: F401 - the generic half, re-exported for the router's modules
    BY_KSERVE,
    DATATYPES,
    decode_request,
    decode_response,
    deserialize_bytes,
    encode_request,
    from_contents,
    from_raw,
    serialize_bytes,
)
from opml_inference_router.kserve.validation import check_input, check_input_names, check_output_names
from opml_inference_router_contract.model_config import ModelConfig


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
        arrays[tensor.name] = (from_raw(raw[index], datatype, shape, field) if raw
                               else from_contents(tensor.contents, datatype, shape, field))
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
