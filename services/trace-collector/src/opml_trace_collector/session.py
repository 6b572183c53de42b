"""The session file: a run's always-on step metrics as JSON lines, the portable export format.

One ``opml.traces.v1.StepRecord`` per line in protobuf's JSON mapping (``json_format``), so any
tool reads it and :mod:`google.protobuf.json_format` parses it back losslessly. A name ending in
``.gz`` is gzip-compressed. Written by ``opml trace export`` (one file per run) and readable by
``opml trace summary`` / ``compare`` offline.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

from google.protobuf import json_format
from opml.traces.v1.events_pb2 import StepRecord

SUFFIXES = (".jsonl", ".jsonl.gz")


def is_session_file(path: Path) -> bool:
    return path.name.endswith(SUFFIXES)


def _open(path: Path, mode: str) -> IO[str]:
    if path.name.endswith(".gz"):
        return gzip.open(path, mode + "t", encoding="utf-8")
    return open(path, mode, encoding="utf-8")


def record_to_line(record: StepRecord) -> str:
    return json.dumps(json_format.MessageToDict(record), separators=(",", ":"), sort_keys=True)


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
