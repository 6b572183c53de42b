"""A bundle's typed scalar values and their opml.bundles.v1 ``Value`` message.

In the contract because both ends convert them: the client when it adds a bundle, the store
when it answers.
"""

from __future__ import annotations

from opml.bundles.v1 import bundles_pb2 as pb

Value = int | float | str | bool | bytes

_VALUE_FIELDS = (("bool_value", bool), ("int_value", int), ("float_value", float),
                 ("string_value", str), ("bytes_value", bytes))


def value_to_proto(value: Value) -> pb.Value:
    for field, kind in _VALUE_FIELDS:  # bool before int: True is an int in Python
        if isinstance(value, kind):
            return pb.Value(**{field: value})
    raise TypeError(f"unsupported value type {type(value).__name__}")


def value_from_proto(message: pb.Value) -> Value | None:
    kind = message.WhichOneof("kind")
    return getattr(message, kind) if kind else None
