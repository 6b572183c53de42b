"""Checks a request's tensors against the model's declared form before any bytes are decoded.

Each refusal is an ``InvalidArgument`` whose field is ``inputs[<name>]`` (or ``outputs[<name>]``) and
whose message shows the expected form beside what came, in the protocol's own spelling, e.g.
``inputs[image]: expected FP32 [-1,3,224,224], got INT64 [1,3,224,224]``, so a client developer
can fix the call without reading the server's config.
"""

from __future__ import annotations

from collections.abc import Sequence

from opml_common.errors import InvalidArgument
from opml_common.kserve_codec import (  # noqa: F401 - re-exported: the router's modules import them from here
    MAX_BYTES_ELEMENTS,
    MAX_ELEMENTS,
    describe,
    element_count,
    kserve_name,
    tensor_field,
)
from opml_inference_router_contract.model_config import ModelConfig, TensorSpec


def expected_shape(spec: TensorSpec, config: ModelConfig) -> list[int]:
    """The full shape a request must send: ``[-1, *dims]`` when the model batches, else ``dims``."""
    return [-1, *spec.dims] if config.max_batch_size > 0 else list(spec.dims)


def expected_form(spec: TensorSpec, config: ModelConfig) -> str:
    return describe(kserve_name(spec.data_type), expected_shape(spec, config))


def check_input(spec: TensorSpec, config: ModelConfig, datatype: str, shape: Sequence[int],
                *, max_batch: int) -> None:
    """Refuses a tensor whose datatype, rank or fixed dims differ from ``spec``, or whose batch
    exceeds ``max_batch`` (the model's ``max_batch_size``, less on kinds with smaller fixed shapes).

    Raises:
        InvalidArgument: field ``inputs[<name>]``, message with the expected and the received form.
    """
    want = expected_shape(spec, config)
    fits = datatype == kserve_name(spec.data_type) and len(shape) == len(want) and all(
        w == -1 or w == s for w, s in zip(want, shape))
    if not fits or any(s < 0 for s in shape):
        raise InvalidArgument(f"inputs[{spec.name}]",
                              f"expected {expected_form(spec, config)}, got {describe(datatype, shape)}")
    if config.max_batch_size > 0:
        if shape[0] < 1:
            raise InvalidArgument(f"inputs[{spec.name}]", f"batch size must be >= 1, but got {shape[0]}")
        if shape[0] > max_batch:
            raise InvalidArgument(f"inputs[{spec.name}]",
                                  f"batch size must be <= {max_batch} (max_batch_size), but got {shape[0]}")


def check_input_names(names: Sequence[str], config: ModelConfig) -> dict[str, TensorSpec]:
    """Refuses unknown, repeated or missing input names; returns the inputs' specs by name (the
    caller checks each tensor against its spec without building the map again).

    Raises:
        InvalidArgument: field ``inputs[<name>]`` (unknown or repeated) or ``inputs`` (missing).
    """
    declared = {spec.name: spec for spec in config.inputs}
    seen: set[str] = set()
    for name in names:
        if name not in declared:
            listing = ", ".join(f"{s.name} ({expected_form(s, config)})" for s in config.inputs)
            raise InvalidArgument(f"inputs[{tensor_field(name)}]",
                                  f"is not an input of model {config.name}; its inputs are {listing}")
        if name in seen:
            raise InvalidArgument(f"inputs[{name}]", "appears twice; send each input once")
        seen.add(name)
    if len(seen) < len(declared):  # every name is declared and unique: some input is missing
        missing = [spec for spec in config.inputs if spec.name not in seen]
        listing = ", ".join(f"{s.name} ({expected_form(s, config)})" for s in missing)
        raise InvalidArgument("inputs", f"model {config.name} needs input {listing}, but the request lacks it")
    return declared


def check_output_names(names: Sequence[str], config: ModelConfig) -> None:
    """Refuses a requested output the model does not have.

    Raises:
        InvalidArgument: field ``outputs[<name>]``.
    """
    declared = {spec.name for spec in config.outputs}
    for name in names:
        if name not in declared:
            raise InvalidArgument(f"outputs[{tensor_field(name)}]", f"is not an output of model {config.name}; its outputs are "
                                                      f"{', '.join(s.name for s in config.outputs)}")
