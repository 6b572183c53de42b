"""A span's rows as typed columns, read from its CSV files within fixed bounds.

A span is one or more ``.csv`` files with the same header row. Every read is bounded: the files' total
size and number (checked before any is opened), columns, rows, the length of one cell and of a column
name (a span that breaks a bound is refused with the bound named, never half read). An empty cell is a
missing value; ``nan`` in a numeric column is a NaN, which is not missing (TFDV counts them apart).

Column types are inferred from the values, in this order: ``bool`` (only true/false spellings),
``int`` (NaNs allowed), ``float``, else ``string``; a column with no value at all has type None.

The files are streamed twice, never held whole: the first pass checks them and infers each column's
type, the second keeps numeric and bool columns as float64 arrays (8 bytes a cell) and the text of
string columns, and of the columns a caller names in ``keep_text``, with each distinct value stored
once. Memory is then about 9 bytes a numeric cell plus the distinct strings, instead of a Python
string per cell (17 times the CSV's size when every cell was kept as text).
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAX_SPAN_BYTES = 1 << 30
"""Largest span read, all its CSV files together (1 GiB)."""
MAX_SPAN_FILES = 1_000
"""Most CSV files in one span."""
MAX_ROWS = 5_000_000
"""Most rows in one span, all its files together."""
MAX_COLUMNS = 1_000
"""Most columns of a span's header."""
MAX_CELL_CHARS = 64 * 1024
"""Longest cell in characters."""
MAX_NAME_CHARS = 256
"""Longest column name (names are quoted in anomalies and results)."""

TYPES = ("bool", "int", "float", "string")
NUMERIC_TYPES = ("int", "float")

_BOOL_VALUES = {"true": True, "false": False}
_INT = re.compile(r"[+-]?[0-9]{1,18}")
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]{1,4})?")
_NANS = {"nan", "+nan", "-nan"}
_NAMED_FLOATS = {"nan", "+nan", "-nan", "inf", "+inf", "-inf", "infinity", "+infinity", "-infinity"}

Rows = Callable[[], Iterator[Sequence[str]]]
"""Starts a new pass over a span's data rows (its header excluded)."""


class TableError(ValueError):
    """A span cannot be read: a bound broken, a malformed file, headers that differ."""


@dataclass(frozen=True)
class Column:
    """One column: its inferred ``type``, which rows are empty (``missing``), for numeric and bool
    columns the values as float64 (missing rows are NaN there: ``missing`` tells them apart from a NaN
    in the data), and for string columns and those read with ``keep_text`` the text of each row
    (``None`` = missing; else ``text`` is None)."""

    name: str
    type: str | None
    missing: np.ndarray
    numbers: np.ndarray | None
    text: list[str | None] | None

    def __len__(self) -> int:
        return len(self.missing)


@dataclass(frozen=True)
class Table:
    columns: dict[str, Column]
    rows: int

    def column(self, name: str) -> Column:
        return self.columns[name]


def read_span(directory: Path, *, keep_text: Collection[str] = ()) -> Table:
    """The span in ``directory`` (its ``*.csv`` files, in name order, all with the same header).

    Raises:
        TableError: no CSV file, a bound broken, a file that is not UTF-8 CSV, headers that differ.
    """
    files = sorted(p for p in directory.glob("*.csv") if p.is_file())
    if not files:
        raise TableError(f"span folder {directory} holds no .csv file")
    if len(files) > MAX_SPAN_FILES:
        raise TableError(f"span folder {directory} holds {len(files)} CSV files, more than {MAX_SPAN_FILES}")
    total = sum(p.stat().st_size for p in files)
    if total > MAX_SPAN_BYTES:
        raise TableError(f"span folder {directory} holds {total} bytes of CSV, more than {MAX_SPAN_BYTES}")
    header: list[str] | None = None
    for path in files:
        with _open(path) as file:
            file_header = _header(csv.reader(file, strict=True), path.name)
        if header is None:
            header = file_header
        elif file_header != header:
            raise TableError(f"{path.name}: header {file_header[:10]} differs from {files[0].name}'s {header[:10]}")
    assert header is not None

    def rows() -> Iterator[Sequence[str]]:
        for path in files:
            with _open(path) as file:
                reader = csv.reader(file, strict=True)
                _header(reader, path.name)
                yield from _data_rows(reader, path.name, len(header))

    return _build(header, rows, keep_text)


def read_csv_text(text: str, name: str = "span.csv", *, keep_text: Collection[str] = ()) -> Table:
    """One CSV document as a table (same rules and bounds as :func:`read_span`)."""
    with _cell_limit():
        header = _header(csv.reader(io.StringIO(text, newline=""), strict=True), name)

    def rows() -> Iterator[Sequence[str]]:
        with _cell_limit():
            reader = csv.reader(io.StringIO(text, newline=""), strict=True)
            _header(reader, name)
            yield from _data_rows(reader, name, len(header))

    return _build(header, rows, keep_text)


def from_rows(header: Sequence[str], rows: Sequence[Sequence[str]], *, keep_text: Collection[str] = ()) -> Table:
    """Typed columns out of text rows (tests build tables with it)."""
    return _build(list(header), lambda: iter(rows), keep_text)


class _open:  # noqa: N801 - used as a context manager, like open()
    """A span file as text, with the cell limit set while it is read; a byte that is not UTF-8 is a
    TableError naming the file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> Iterator[str]:
        self.limit = _cell_limit()
        self.limit.__enter__()
        self.file = self.path.open(encoding="utf-8-sig", newline="")
        return _decoded(self.file, self.path.name)

    def __exit__(self, *exc: object) -> None:
        self.file.close()
        self.limit.__exit__(*exc)


def _decoded(file: Iterator[str], name: str) -> Iterator[str]:
    try:
        yield from file
    except UnicodeDecodeError as error:
        raise TableError(f"{name}: not UTF-8 text ({error.reason})") from None


class _cell_limit:  # noqa: N801
    """csv's field size limit at :data:`MAX_CELL_CHARS` for the block, restored after."""

    def __enter__(self) -> None:
        self.previous = csv.field_size_limit(MAX_CELL_CHARS)

    def __exit__(self, *exc: object) -> None:
        csv.field_size_limit(self.previous)


def _header(reader: Iterator[list[str]], name: str) -> list[str]:
    try:
        header = next(reader, None)
    except csv.Error as error:
        raise TableError(f"{name}: header: {error}") from None
    if header is None:
        raise TableError(f"{name}: empty file, a header row is required")
    if len(header) > MAX_COLUMNS:
        raise TableError(f"{name}: {len(header)} columns, more than {MAX_COLUMNS}")
    header = [h.strip() for h in header]
    problems = [f"column {i + 1} has no name" for i, h in enumerate(header) if not h]
    problems += [f"column {i + 1}'s name has {len(h)} characters, more than {MAX_NAME_CHARS}"
                 for i, h in enumerate(header) if len(h) > MAX_NAME_CHARS]
    seen: set[str] = set()
    for column in header:
        if column in seen:
            problems.append(f"column {column!r} appears twice")
        seen.add(column)
    if problems:
        raise TableError(f"{name}: header: {'; '.join(problems)}")
    return header


def _data_rows(reader: Iterator[list[str]], name: str, width: int) -> Iterator[list[str]]:
    line = 1
    try:
        for row in reader:
            line = getattr(reader, "line_num", line + 1)
            if not row:
                continue  # a blank line
            if len(row) != width:
                raise TableError(f"{name}: line {line} has {len(row)} cells, the header {width}")
            yield row
    except csv.Error as error:
        raise TableError(f"{name}: line {getattr(reader, 'line_num', line)}: {error}") from None


class _TypeState:
    """What every value of a column seen so far parses as (the first pass)."""

    __slots__ = ("bool_ok", "int_ok", "float_ok", "seen", "whole")

    def __init__(self) -> None:
        self.bool_ok = self.int_ok = self.float_ok = True
        self.seen = self.whole = False

    def see(self, value: str) -> None:
        value = value.strip()
        if not value:
            return
        self.seen = True
        lower = value.lower()
        if self.bool_ok and lower not in _BOOL_VALUES:
            self.bool_ok = False
        if self.int_ok:
            if _INT.fullmatch(value):
                self.whole = True
            elif lower not in _NANS:
                self.int_ok = False
        if self.float_ok and lower not in _NAMED_FLOATS and _FLOAT.fullmatch(value) is None:
            self.float_ok = False

    @property
    def type(self) -> str | None:
        if not self.seen:
            return None
        if self.bool_ok:
            return "bool"
        if self.int_ok and self.whole:
            return "int"  # NaNs do not make an int column a float one (a NaN flood is its own anomaly)
        return "float" if self.float_ok else "string"


def infer_type(values: Sequence[str]) -> str | None:
    """The narrowest type every value parses as (None for no value)."""
    state = _TypeState()
    for value in values:
        state.see(value)
    return state.type


def _build(header: list[str], rows: Rows, keep_text: Collection[str]) -> Table:
    states = [_TypeState() for _ in header]
    count = 0
    for row in rows():
        count += 1
        if count > MAX_ROWS:
            raise TableError(f"more than {MAX_ROWS} rows in the span")
        for state, value in zip(states, row, strict=True):
            state.see(value)
    kinds = [state.type for state in states]
    missing = [np.zeros(count, dtype=bool) for _ in header]
    numbers = [np.full(count, np.nan) if kind in ("bool", *NUMERIC_TYPES) else None for kind in kinds]
    texts: list[list[str | None] | None] = [
        [None] * count if kind in ("string", None) or name in keep_text else None
        for name, kind in zip(header, kinds, strict=True)]
    distinct: list[dict[str, str]] = [{} for _ in header]
    for index, row in enumerate(rows()):
        for column, raw in enumerate(row):
            value = raw.strip()
            if not value:
                missing[column][index] = True
                continue
            array, text = numbers[column], texts[column]
            if array is not None:
                array[index] = (1.0 if value.lower() == "true" else 0.0) if kinds[column] == "bool" else float(value)
            if text is not None:
                text[index] = distinct[column].setdefault(value, value)  # each distinct value stored once
    columns = {name: Column(name, kinds[i], missing[i], numbers[i], texts[i]) for i, name in enumerate(header)}
    return Table(columns, count)


def numeric_matrix(table: Table, names: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """The columns ``names`` as a float64 matrix ``[rows, len(names)]`` and the mask of rows with every
    value present and finite.

    Raises:
        TableError: a column is absent or holds text that is not a number.
    """
    problems = []
    for name in names:
        if name not in table.columns:
            problems.append(f"column {name!r} is not in the span")
        elif table.columns[name].numbers is None and table.columns[name].type is not None:
            problems.append(f"column {name!r} holds text ({table.columns[name].type}), not numbers")
    if problems:
        raise TableError("; ".join(problems))
    matrix = np.empty((table.rows, len(names)), dtype=np.float64)
    for index, name in enumerate(names):
        numbers = table.columns[name].numbers
        matrix[:, index] = numbers if numbers is not None else np.nan
    usable = np.isfinite(matrix).all(axis=1) if names else np.ones(table.rows, dtype=bool)
    return matrix, usable
