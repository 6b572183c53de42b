"""How large a ModelInferRequest a model accepts, from its config; checked by the router in O(1).

The router forwards requests as the bytes that arrived (:mod:`.wire`), so the serialized length is
known before anything is copied or forwarded. A request longer than its model's limit is refused
there, as INVALID_ARGUMENT on field ``request`` (it can never succeed, so it is not the retriable
RESOURCE_EXHAUSTED of overload; the message names the limit and where it comes from), without
reaching a worker, whose decode of a 63 MB message would otherwise cost a co-hosted model its p99.

A model's limit (:func:`request_limit`):

* its config's ``max_request_bytes``, when set;
* else, when every input has a fixed size (no BYTES input, no -1 dim): the sum over inputs of
  ``max(1, max_batch_size) x product of dims x the element's largest wire size`` (raw itemsize, or
  the typed ``contents`` encoding where that is larger: an int8 sent as a varint takes up to 10
  bytes) plus :data:`HEADER_ALLOWANCE` for names, shapes, parameters and requested outputs;
* else the router's default (``OPML_INFERENCE_ROUTER_MAX_REQUEST_BYTES``).

Never more than the router's gRPC receive cap (``OPML_INFERENCE_ROUTER_GRPC_MAX_RECEIVE_BYTES``,
16 MiB): a longer message is refused by gRPC itself (RESOURCE_EXHAUSTED: gRPC's status for a message
over its cap; the servicer never runs, so no field can be named) without being assembled.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from opml_inference_router_contract.model_config import ModelConfig

DEFAULT_MAX_REQUEST_BYTES = 4 << 20
"""Limit of a model whose config fixes no size (a BYTES input or a dynamic dim) and sets no
``max_request_bytes``: 4 MiB, gRPC's own default message cap."""

DEFAULT_GRPC_MAX_RECEIVE_BYTES = 16 << 20
"""The router's gRPC receive cap, and the ceiling of every model's limit: 16 MiB, a quarter of the
platform's 64 MiB. grpc.aio turns a received message into ``bytes`` on the event loop, about 1.5 ms
per MB on 2 cores (a 63 MB one held the loop 90-200 ms), so this bounds what one request can stall the
co-hosted models by; gRPC refuses a longer message as its length arrives (RESOURCE_EXHAUSTED), for
~20 ms of CPU off the loop."""

HEADER_ALLOWANCE = 64 << 10
"""Bytes allowed beyond the tensors of a fixed-size model: tensor names, datatypes and shapes,
parameters, requested outputs, ids (a real request's are well under 1 KiB)."""

# Largest bytes one element takes on the wire: raw (itemsize) or typed contents, packed.
_WIRE_ITEMSIZE = {
    "bool": 1, "uint8": 5, "uint16": 5, "uint32": 5, "uint64": 10,  # uint_contents: varint of a uint32
    "int8": 10, "int16": 10, "int32": 10, "int64": 10,  # a negative int32 varint is sign-extended to 10 bytes
    "fp16": 2, "bf16": 2, "fp32": 4, "fp64": 8,  # fp16/bf16: raw only
}


@dataclass(frozen=True, slots=True)
class RequestLimit:
    """Largest serialized ModelInferRequest of a model (``bytes``) and where the number comes from."""

    bytes: int
    basis: str

    def __post_init__(self) -> None:
        if self.bytes < 1:
            raise ValueError(f"a request limit must be >= 1 byte, but got {self.bytes}")

    def capped(self, ceiling: int, what: str) -> RequestLimit:
        """This limit, or ``ceiling`` (named by ``what``) when that is smaller."""
        if self.bytes <= ceiling:
            return self
        return RequestLimit(ceiling, f"{what}, below the {self.bytes} bytes of {self.basis}")


def request_limit(config: ModelConfig, *, default: int = DEFAULT_MAX_REQUEST_BYTES) -> RequestLimit:
    """The limit of a model version with ``config`` (see the module doc); ``default`` for one whose
    config fixes no size. O(inputs x rank), computed once per deployment, never per request."""
    if config.max_request_bytes is not None:
        return RequestLimit(config.max_request_bytes, "max_request_bytes of its config")
    unfixed = [spec.name for spec in config.inputs if spec.data_type == "string" or -1 in spec.dims]
    if unfixed:
        return RequestLimit(default, f"OPML_INFERENCE_ROUTER_MAX_REQUEST_BYTES, the default for a model whose "
                                     f"inputs have no fixed size ({', '.join(unfixed[:4])}"
                                     f"{', ...' if len(unfixed) > 4 else ''}: BYTES or a -1 dim); set "
                                     f"max_request_bytes in its config to change it")
    batch = max(1, config.max_batch_size)
    tensors = sum(batch * prod(spec.dims) * _WIRE_ITEMSIZE[spec.data_type] for spec in config.inputs)
    return RequestLimit(tensors + HEADER_ALLOWANCE,
                        f"max_batch_size {config.max_batch_size} x its inputs' fixed dims x item size, "
                        f"{tensors} bytes, + {HEADER_ALLOWANCE} for the header")


def largest(limits: list[RequestLimit]) -> RequestLimit | None:
    """The most permissive of several versions' limits (a request may name any served version)."""
    return max(limits, key=lambda limit: limit.bytes, default=None)
