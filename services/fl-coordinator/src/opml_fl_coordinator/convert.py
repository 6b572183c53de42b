"""Conversions between the core's types and opml.fl.v1 messages, and weights <-> chunks.

Weights are sent as :class:`ArrayChunk` messages of at most ``chunk_bytes`` of data each, array
after array, so no message grows with the model. :class:`ArrayAssembler` rebuilds arrays from
chunks a client sent and bounds everything before it allocates: the number of arrays, each
array's dtype (floating only; never an object array) and shape, the total bytes, and that chunks
come in order without gaps or overlap.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
from google.protobuf.timestamp_pb2 import Timestamp
from opml.fl.v1 import fl_pb2 as pb

from opml_common.errors import InvalidArgument
from opml_fl_coordinator.federation import Phase, RoundRecord, Task
from opml_fl_coordinator.weights import Weights

if TYPE_CHECKING:
    from opml_fl_coordinator.coordinator import Hosted

STATES = {Phase.WAITING: pb.FEDERATION_STATE_WAITING, Phase.RUNNING: pb.FEDERATION_STATE_RUNNING,
          Phase.COMPLETED: pb.FEDERATION_STATE_COMPLETED, Phase.STOPPED: pb.FEDERATION_STATE_STOPPED}
MAX_ARRAYS = 4096
MAX_DIMS = 8
_NAME = re.compile(r"^federations/([^/]+)$")


def parse_federation_name(field: str, name: str) -> str:
    match = _NAME.match(name)
    if not match:
        raise InvalidArgument(field, f"must look like federations/{{federation}}, but got {name[:100]!r}")
    return match.group(1)


def federation_name(federation_id: str) -> str:
    return f"federations/{federation_id}"


def _timestamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def federation_to_proto(hosted: Hosted) -> pb.Federation:
    federation = hosted.federation
    last = federation.history[-1].metrics if federation.history else {}
    return pb.Federation(
        name=federation_name(federation.federation_id), state=STATES[federation.phase],
        config_yaml=hosted.config_yaml, completed_rounds=federation.version, total_rounds=federation.config.rounds,
        reason=federation.reason, create_time=_timestamp(federation.created_at),
        present_clients=len(federation.profiles.present()), known_clients=len(federation.profiles.clients),
        metrics={k: float(v) for k, v in last.items()}, model_bundle=hosted.model_bundle)


def round_to_proto(federation_id: str, record: RoundRecord) -> pb.Round:
    return pb.Round(
        name=f"{federation_name(federation_id)}/rounds/{record.number}", number=record.number,
        start_time=_timestamp(record.started_at), end_time=_timestamp(record.ended_at),
        duration_seconds=record.duration_s, participants=record.participants, dropped=record.dropped,
        rejected=record.rejected, tier=-1 if record.tier is None else record.tier, num_examples=record.num_examples,
        aggregated=record.aggregated, metrics=record.metrics)


def task_header(task: Task | None) -> pb.TaskHeader:
    """The header of ``task`` (None: the federation is done)."""
    if task is None:
        return pb.TaskHeader(kind=pb.TASK_KIND_DONE)
    config = {k: float(v) for k, v in task.config.items() if isinstance(v, (int, float))}
    return pb.TaskHeader(task_id=task.task_id, kind=pb.TASK_KIND_FIT if task.kind == "fit" else pb.TASK_KIND_INIT,
                         round=task.round, config=config, deadline=_timestamp(task.deadline_at),
                         num_arrays=len(task.weights or []))


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


def metrics_from_proto(metrics: Mapping[str, float]) -> tuple[dict[str, float], list[str]]:
    """At most 64 metrics with names of at most 64 characters: the finite ones, and the names of
    those that are not (a diverged loss: left out, the update itself is not refused for it)."""
    if len(metrics) > 64:
        raise InvalidArgument("header.metrics", f"at most 64 metrics, but got {len(metrics)}")
    long = [k[:100] for k in metrics if len(k) > 64]
    if long:
        raise InvalidArgument("header.metrics", f"names must be <= 64 characters: {long[:3]}")
    finite = {k: v for k, v in metrics.items() if math.isfinite(v)}
    return finite, sorted(set(metrics) - set(finite))
