"""The session file: a run's always-on step metrics as JSON lines, the portable export format.

One ``opml.traces.v1.StepRecord`` per line in protobuf's JSON mapping (``json_format``), so any
tool reads it and :mod:`google.protobuf.json_format` parses it back losslessly. A name ending in
``.gz`` is gzip-compressed. Written by ``opml trace export`` (one file per run) and readable by
``opml trace summary`` / ``compare`` offline.
"""

from __future__ import annotations

import datetime
import gzip
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

from google.protobuf import json_format
from opml.traces.v1.events_pb2 import StepKind, StepRecord

SUFFIXES = (".jsonl", ".jsonl.gz")


def is_session_file(path: Path) -> bool:
    return path.name.endswith(SUFFIXES)


def _open(path: Path, mode: str) -> IO[str]:
    if path.name.endswith(".gz"):
        return gzip.open(path, mode + "t", encoding="utf-8")
    return open(path, mode, encoding="utf-8")


def record_to_line(record: StepRecord) -> str:
    return json.dumps(json_format.MessageToDict(record), separators=(",", ":"), sort_keys=True)


_KIND_NAMES = {value.number: json.dumps(value.name) for value in StepKind.DESCRIPTOR.values}
_EPOCH = datetime.datetime(1970, 1, 1)
_last_second: tuple[int, str] = (-1, "")  # the last start second formatted and its text (steps share seconds)


def step_to_line(step: int, kind: int, signature: str, start_time: float, duration_s: float, input_wait_s: float,
                 examples: int) -> str:
    """:func:`record_to_line` of the StepRecord of these values (the tracer's ``Step``), the same text,
    without building the message or walking its descriptor: ~5x cheaper (3 against 17 µs), and the tracer writes one
    line per step of every traced job. Proto3's JSON mapping: default values left out, int64 as
    strings, enums by name, keys sorted; ``start_time`` is made a Timestamp as the tracer does
    (``FromNanoseconds(int(seconds * 1e9))``)."""
    parts = []
    if duration_s:
        parts.append(f'"durationS":{duration_s!r}')
    if examples:
        parts.append(f'"examples":"{examples}"')
    if input_wait_s:
        parts.append(f'"inputWaitS":{input_wait_s!r}')
    if kind:
        parts.append(f'"kind":{_KIND_NAMES.get(kind, kind)}')
    if signature:
        parts.append(f'"signature":{json.dumps(signature)}')
    parts.append(f'"startTime":"{_timestamp_text(int(start_time * 1e9))}"')
    if step:
        parts.append(f'"step":"{step}"')
    return "{" + ",".join(parts) + "}"


def _timestamp_text(nanoseconds: int) -> str:
    """``Timestamp.ToJsonString()`` of a Timestamp of ``nanoseconds`` since the epoch."""
    global _last_second
    seconds, nanos = divmod(nanoseconds, 1_000_000_000)
    cached = _last_second  # one read and one write of the pair: safe from any thread
    if cached[0] != seconds:
        cached = _last_second = (seconds, (_EPOCH + datetime.timedelta(seconds=seconds)).isoformat())
    text = cached[1]
    if nanos == 0:
        return text + "Z"
    if nanos % 1_000_000 == 0:
        return f"{text}.{nanos // 1_000_000:03d}Z"
    if nanos % 1_000 == 0:
        return f"{text}.{nanos // 1_000:06d}Z"
    return f"{text}.{nanos:09d}Z"


def write_session(path: Path, records: Iterable[StepRecord]) -> int:
    """Write ``records`` to ``path`` (replacing it); returns how many were written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with _open(path, "w") as handle:
        for record in records:
            handle.write(record_to_line(record) + "\n")
            count += 1
    return count


def iter_session(path: Path) -> Iterator[StepRecord]:
    """The records of a session file, in file order.

    Raises:
        ValueError: a line is not a StepRecord in JSON (the message names the file and line).
    """
    with _open(path, "r") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                yield json_format.Parse(line, StepRecord())
            except json_format.ParseError as exc:
                raise ValueError(f"{path}:{number}: not a StepRecord in JSON: {exc}") from exc


def read_session(path: Path) -> list[StepRecord]:
    return list(iter_session(path))
