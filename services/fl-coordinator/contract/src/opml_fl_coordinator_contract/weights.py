"""A model's weights as the fl API carries them: a list of numpy arrays, sent as :class:`ArrayChunk`
messages of at most ``chunk_bytes`` of data each, array after array, so no message grows with the model.

In the contract because both ends send and receive them: the coordinator its global model and tasks,
a member its updates. :class:`ArrayAssembler` rebuilds arrays from chunks and bounds everything before
it allocates: the number of arrays, each array's dtype (floating only where asked; never an object
array) and shape, the total bytes, and that chunks come in order without gaps or overlap.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np
from opml.fl.v1 import fl_pb2 as pb

from opml_common.errors import InvalidArgument

Weights = list[np.ndarray]
"""One model's arrays, in the model's layer order (Flower's ``NDArrays``)."""

MAX_ARRAYS = 4096
MAX_DIMS = 8


def chunks(weights: Sequence[np.ndarray], chunk_bytes: int) -> Iterator[pb.ArrayChunk]:
    """Each array's C-order bytes in pieces of at most ``chunk_bytes`` (an empty array: one chunk)."""
    for index, array in enumerate(weights):
        data = memoryview(np.ascontiguousarray(array)).cast("B")
        dtype, shape = np.asarray(array).dtype.str, list(np.shape(array))
        for offset in range(0, max(len(data), 1), chunk_bytes):
            yield pb.ArrayChunk(array_index=index, dtype=dtype, shape=shape, offset=offset,
                                data=bytes(data[offset:offset + chunk_bytes]))


class ArrayAssembler:
    """Rebuilds ``num_arrays`` arrays from chunks, refusing what breaks the bounds.

    Raises (from :meth:`add` and :meth:`result`):
        InvalidArgument: field ``chunk`` or ``header.num_arrays``: a chunk out of order, a
            non-floating or unknown dtype, a shape out of bounds, more than ``max_bytes`` in all,
            or missing data.
    """

    def __init__(self, num_arrays: int, *, max_bytes: int, floating_only: bool = True) -> None:
        if not 0 < num_arrays <= MAX_ARRAYS:
            raise InvalidArgument("header.num_arrays", f"must be in [1, {MAX_ARRAYS}], but got {num_arrays}")
        self.num_arrays, self.max_bytes, self.floating_only = num_arrays, max_bytes, floating_only
        self.arrays: list[np.ndarray] = []
        self._current: bytearray | None = None
        self._spec: tuple[np.dtype, tuple[int, ...], int] | None = None
        self._total = 0

    def _start(self, chunk: pb.ArrayChunk) -> None:
        if chunk.array_index != len(self.arrays) or chunk.array_index >= self.num_arrays:
            raise InvalidArgument("chunk.array_index", f"expected array {len(self.arrays)}, but got "
                                                       f"{chunk.array_index}")
        try:
            dtype = np.dtype(chunk.dtype)
        except TypeError:
            raise InvalidArgument("chunk.dtype", f"is not a numpy dtype: {chunk.dtype[:40]!r}") from None
        if dtype.hasobject or dtype.kind not in ("f" if self.floating_only else "fiub"):
            raise InvalidArgument("chunk.dtype", f"must be a floating point dtype, but got {dtype.str}")
        if len(chunk.shape) > MAX_DIMS or any(d < 0 for d in chunk.shape):
            raise InvalidArgument("chunk.shape", f"must have at most {MAX_DIMS} dimensions >= 0, but got "
                                                 f"{list(chunk.shape)[:10]}")
        size = math.prod(chunk.shape) * dtype.itemsize
        if self._total + size > self.max_bytes:
            raise InvalidArgument("chunk", f"the model exceeds {self.max_bytes} bytes (max_model_bytes)")
        self._total += size
        self._spec = (dtype, tuple(chunk.shape), size)
        self._current = bytearray()

    def add(self, chunk: pb.ArrayChunk) -> None:
        if self._current is None:
            self._start(chunk)
        assert self._spec is not None and self._current is not None
        dtype, shape, size = self._spec
        if chunk.array_index != len(self.arrays) or chunk.offset != len(self._current):
            raise InvalidArgument("chunk.offset", f"expected array {len(self.arrays)} at offset "
                                                  f"{len(self._current)}, but got array {chunk.array_index} at "
                                                  f"{chunk.offset}")
        if len(self._current) + len(chunk.data) > size:
            raise InvalidArgument("chunk.data", f"array {chunk.array_index} has more than its {size} bytes")
        self._current += chunk.data
        if len(self._current) == size:
            self.arrays.append(np.frombuffer(bytes(self._current), dtype=dtype).reshape(shape).copy())
            self._current, self._spec = None, None

    def result(self) -> Weights:
        if len(self.arrays) != self.num_arrays or self._current is not None:
            raise InvalidArgument("chunk", f"the stream ended after {len(self.arrays)} of {self.num_arrays} "
                                           "complete arrays")
        return self.arrays
