"""A model's weights as the fl API carries them: a list of numpy arrays, sent as :class:`ArrayChunk`
messages of at most ``chunk_bytes`` of data each, array after array, so no message grows with the model.

In the contract because both ends send and receive them: the coordinator its global model and tasks,
a member its updates. :class:`ArrayAssembler` rebuilds arrays from chunks and bounds everything before
it allocates: the number of arrays, each array's dtype (floating only where asked; never an object
array) and shape (the model's exactly, where the receiver knows them), the total bytes, and that
chunks come in order without gaps or overlap. Each chunk's data is copied into its array as it
arrives, so an upload costs the receiver its arrays' bytes once, and a chunk past what the shapes
allow is refused before the next one is read.
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

    Args:
        num_arrays: arrays the sender announced.
        max_bytes: most bytes of all arrays together.
        floating_only: accept float16, float32 and float64 only (else also integers and bools).
        shapes: the shapes the arrays must have (the model's, when the receiver knows it): then
            ``num_arrays`` must be their count, each array's shape must be its own, and the bytes
            are bounded by the shapes (8 bytes an element at most, float64).

    Raises (from the constructor, :meth:`add` and :meth:`result`):
        InvalidArgument: field ``header.num_arrays``, ``chunk`` or ``chunk.*``: a count or a shape
            not the model's, a chunk out of order, a non-floating or unknown dtype, a shape out of
            bounds, more than ``max_bytes`` in all, more data than an array holds, or missing data.
    """

    def __init__(self, num_arrays: int, *, max_bytes: int, floating_only: bool = True,
                 shapes: Sequence[Sequence[int]] | None = None) -> None:
        if not 0 < num_arrays <= MAX_ARRAYS:
            raise InvalidArgument("header.num_arrays", f"must be in [1, {MAX_ARRAYS}], but got {num_arrays}")
        if shapes is not None and num_arrays != len(shapes):
            raise InvalidArgument("header.num_arrays", f"the model has {len(shapes)} arrays, but got {num_arrays}")
        self.num_arrays, self.max_bytes, self.floating_only = num_arrays, max_bytes, floating_only
        self.shapes = None if shapes is None else [tuple(int(d) for d in shape) for shape in shapes]
        self.arrays: list[np.ndarray] = []
        self._current: np.ndarray | None = None  # the bytes of the array being filled
        self._filled = 0
        self._total = 0

    def _start(self, chunk: pb.ArrayChunk) -> None:
        index = len(self.arrays)
        if chunk.array_index != index or chunk.array_index >= self.num_arrays:
            raise InvalidArgument("chunk.array_index", f"expected array {index}, but got {chunk.array_index}")
        try:
            dtype = np.dtype(chunk.dtype)
        except TypeError:
            raise InvalidArgument("chunk.dtype", f"is not a numpy dtype: {chunk.dtype[:40]!r}") from None
        if self.floating_only and (dtype.kind != "f" or dtype.itemsize > 8):
            raise InvalidArgument("chunk.dtype", f"must be a floating point dtype of at most 8 bytes (float16, "
                                                 f"float32, float64), but got {dtype.str}")
        if dtype.hasobject or dtype.kind not in "fiub":
            raise InvalidArgument("chunk.dtype", f"must be a numeric dtype, but got {dtype.str}")
        if len(chunk.shape) > MAX_DIMS or any(d < 0 for d in chunk.shape):
            raise InvalidArgument("chunk.shape", f"must have at most {MAX_DIMS} dimensions >= 0, but got "
                                                 f"{list(chunk.shape)[:10]}")
        shape = tuple(chunk.shape)
        if self.shapes is not None and shape != self.shapes[index]:
            raise InvalidArgument("chunk.shape", f"array {index} of the model has shape {list(self.shapes[index])}, "
                                                 f"but got {list(shape)[:10]}")
        size = math.prod(shape) * dtype.itemsize
        if self._total + size > self.max_bytes:
            raise InvalidArgument("chunk", f"the model exceeds {self.max_bytes} bytes (max_model_bytes)")
        self._total += size
        array = np.empty(shape, dtype)  # pages are taken as chunks fill them, not here
        self.arrays.append(array)
        self._current, self._filled = array.reshape(-1).view(np.uint8), 0

    def add(self, chunk: pb.ArrayChunk) -> None:
        if self._current is None:
            self._start(chunk)
        assert self._current is not None
        index = len(self.arrays) - 1
        if chunk.array_index != index or chunk.offset != self._filled:
            raise InvalidArgument("chunk.offset", f"expected array {index} at offset {self._filled}, but got "
                                                  f"array {chunk.array_index} at {chunk.offset}")
        end = self._filled + len(chunk.data)
        if end > len(self._current):
            raise InvalidArgument("chunk.data", f"array {index} has more than its {len(self._current)} bytes")
        self._current[self._filled:end] = np.frombuffer(chunk.data, np.uint8)
        self._filled = end
        if end == len(self._current):
            self._current = None

    def received(self) -> Weights:
        """The arrays of a stream that announced no count (``num_arrays`` is then its bound): every
        array begun must be complete."""
        if self._current is not None:
            raise InvalidArgument("chunk", f"the stream ended inside array {len(self.arrays) - 1}")
        return self.arrays

    def result(self) -> Weights:
        if len(self.arrays) != self.num_arrays or self._current is not None:
            complete = len(self.arrays) - (self._current is not None)
            raise InvalidArgument("chunk", f"the stream ended after {complete} of {self.num_arrays} complete arrays")
        return self.arrays
