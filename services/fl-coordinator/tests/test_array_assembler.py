"""The contract's ArrayAssembler: arrays rebuilt from chunks, every bound checked as each chunk
arrives (the service test shows what that saves the coordinator's memory)."""

from __future__ import annotations

import numpy as np
import pytest
from opml.fl.v1 import fl_pb2 as pb

from opml_common.errors import InvalidArgument
from opml_fl_coordinator_contract.weights import ArrayAssembler, chunks

MODEL = [np.arange(12, dtype=np.float32).reshape(3, 4), np.zeros(0, np.float32), np.linspace(0, 1, 5)]
SHAPES = [w.shape for w in MODEL]


def assemble(weights, chunk_bytes=7, **bounds):
    assembler = ArrayAssembler(len(weights), **{"max_bytes": 1 << 20, **bounds})
    for chunk in chunks(weights, chunk_bytes):
        assembler.add(chunk)
    return assembler.result()


def test_arrays_of_the_models_shapes_come_back_as_they_were_sent():
    for weights in (MODEL, [w.astype(np.float16) for w in MODEL], [w.astype(">f8") for w in MODEL]):
        got = assemble(weights, shapes=SHAPES)
        assert [(g.dtype, g.shape) for g in got] == [(w.dtype, w.shape) for w in weights]
        assert all(np.array_equal(g, w) for g, w in zip(got, weights, strict=True))


def test_a_count_or_a_shape_not_the_models_is_refused_at_its_first_chunk():
    with pytest.raises(InvalidArgument) as caught:
        ArrayAssembler(4, max_bytes=1 << 20, shapes=SHAPES)
    assert caught.value.field == "header.num_arrays" and "has 3 arrays, but got 4" in caught.value.message
    assembler = ArrayAssembler(3, max_bytes=1 << 40, shapes=SHAPES)
    huge = pb.ArrayChunk(array_index=0, dtype="<f4", shape=[1 << 30], offset=0, data=b"\0" * 64)
    with pytest.raises(InvalidArgument) as caught:
        assembler.add(huge)
    assert caught.value.field == "chunk.shape"
    assert caught.value.message == "chunk.shape: array 0 of the model has shape [3, 4], but got [1073741824]"
    assert assembler.arrays == []  # nothing was allocated for it


def test_more_data_than_an_array_holds_and_arrays_past_the_count_are_refused():
    assembler = ArrayAssembler(1, max_bytes=1 << 20, shapes=[(2,)])
    with pytest.raises(InvalidArgument, match="chunk.data: array 0 has more than its 8 bytes"):
        assembler.add(pb.ArrayChunk(array_index=0, dtype="<f4", shape=[2], offset=0, data=b"\0" * 12))
    assembler = ArrayAssembler(1, max_bytes=1 << 20, shapes=[(2,)])
    assembler.add(pb.ArrayChunk(array_index=0, dtype="<f4", shape=[2], offset=0, data=b"\0" * 8))
    with pytest.raises(InvalidArgument) as caught:
        assembler.add(pb.ArrayChunk(array_index=1, dtype="<f4", shape=[2], offset=0, data=b"\0" * 8))
    assert caught.value.field == "chunk.array_index"


def test_only_floats_of_at_most_8_bytes_and_at_most_max_bytes_in_all():
    for dtype in ("<i4", "|O", "<c8", np.dtype(np.longdouble).str):
        if np.dtype(dtype).kind == "f" and np.dtype(dtype).itemsize <= 8:
            continue  # a platform whose long double is a double
        with pytest.raises(InvalidArgument) as caught:
            ArrayAssembler(1, max_bytes=1 << 20).add(pb.ArrayChunk(array_index=0, dtype=dtype, shape=[1]))
        assert caught.value.field == "chunk.dtype"
    with pytest.raises(InvalidArgument, match="exceeds 100 bytes"):
        assemble([np.zeros(26, np.float32)], max_bytes=100)


def test_chunks_out_of_order_or_a_stream_that_ends_early_are_refused():
    parts = list(chunks(MODEL, 7))
    assembler = ArrayAssembler(3, max_bytes=1 << 20, shapes=SHAPES)
    assembler.add(parts[0])
    with pytest.raises(InvalidArgument, match="chunk.offset: expected array 0 at offset 7"):
        assembler.add(parts[2])
    assembler = ArrayAssembler(3, max_bytes=1 << 20, shapes=SHAPES)
    for part in parts[:-1]:
        assembler.add(part)
    with pytest.raises(InvalidArgument, match="after 2 of 3 complete arrays"):
        assembler.result()
