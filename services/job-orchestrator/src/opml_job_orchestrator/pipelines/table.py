"""A span's rows as typed columns, read from its CSV files within fixed bounds.

A span is one or more ``.csv`` files with the same header row. Every read is bounded before it is
parsed: the files' total size, the number of files, columns, rows and the length of one cell (a
span that breaks a bound is refused with the bound named, never half read). An empty cell is a
missing value; ``nan`` in a numeric column is a NaN, which is not missing (TFDV counts them apart).

Column types are inferred from the values, in this order: ``bool`` (only true/false spellings),
``int`` (NaNs allowed), ``float``, else ``string``; a column with no value at all has type None.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Sequence
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


class TableError(ValueError):
    """A span cannot be read: a bound broken, a malformed file, headers that differ."""


@dataclass(frozen=True)
class Column:
    """One column: its inferred ``type``, the raw text of each row (``None`` = missing) and, for
    numeric and bool columns, the values as float64 (missing rows are NaN there: ``missing`` tells
    them apart from a NaN in the data)."""

    name: str
    type: str | None
    text: tuple[str | None, ...]
    missing: np.ndarray
    numbers: np.ndarray | None

    def __len__(self) -> int:
        return len(self.text)


@dataclass(frozen=True)
class Table:
    columns: dict[str, Column]
    rows: int

    def column(self, name: str) -> Column:
        return self.columns[name]


def read_span(directory: Path) -> Table:
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
    rows: list[list[str]] = []
    for path in files:
        with path.open("rb") as file:
            data = file.read(MAX_SPAN_BYTES + 1)
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as error:
            raise TableError(f"{path.name}: not UTF-8 text ({error.reason} at byte {error.start})") from None
        file_header, file_rows = _parse_csv(text, path.name, limit=MAX_ROWS - len(rows))
        if header is None:
            header = file_header
        elif file_header != header:
            raise TableError(f"{path.name}: header {file_header[:10]} differs from {files[0].name}'s {header[:10]}")
        rows.extend(file_rows)
    assert header is not None
    return from_rows(header, rows)


def read_csv_text(text: str, name: str = "span.csv") -> Table:
    """One CSV document as a table (same rules and bounds as :func:`read_span`)."""
    header, rows = _parse_csv(text, name, limit=MAX_ROWS)
    return from_rows(header, rows)


def _parse_csv(text: str, name: str, *, limit: int) -> tuple[list[str], list[list[str]]]:
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    previous_limit = csv.field_size_limit(MAX_CELL_CHARS)
    try:
        header = next(reader, None)
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
        rows: list[list[str]] = []
        for row in reader:
            if not row:
                continue  # a blank line
            if len(row) != len(header):
                raise TableError(f"{name}: line {reader.line_num} has {len(row)} cells, the header {len(header)}")
            if len(rows) >= limit:
                raise TableError(f"{name}: more than {MAX_ROWS} rows in the span")
            rows.append(row)
    except csv.Error as error:
        raise TableError(f"{name}: line {reader.line_num}: {error}") from None
    finally:
        csv.field_size_limit(previous_limit)
    return header, rows


def from_rows(header: Sequence[str], rows: Sequence[Sequence[str]]) -> Table:
    """Typed columns out of text rows (tests build tables with it)."""
    columns = {}
    for index, name in enumerate(header):
        text = tuple(_cell(row[index]) for row in rows)
        columns[name] = _typed(name, text)
    return Table(columns, len(rows))


def _cell(value: str) -> str | None:
    value = value.strip()
    return value if value else None


def _typed(name: str, text: tuple[str | None, ...]) -> Column:
    missing = np.fromiter((v is None for v in text), dtype=bool, count=len(text))
    present = [v for v in text if v is not None]
    kind = infer_type(present)
    numbers = None
    if kind in NUMERIC_TYPES or kind == "bool":
        numbers = np.full(len(text), np.nan)
        if kind == "bool":
            numbers[~missing] = [1.0 if v.lower() == "true" else 0.0 for v in present]
        else:
            numbers[~missing] = np.asarray(present, dtype=np.float64)  # numpy parses the text (nan, inf too)
    return Column(name, kind, text, missing, numbers)


def infer_type(values: Sequence[str]) -> str | None:
    """The narrowest type every value parses as (None for no value)."""
    if not values:
        return None
    if all(v.lower() in _BOOL_VALUES for v in values):
        return "bool"
    numbers = [v for v in values if v.lower() not in _NANS]
    if numbers and all(_INT.fullmatch(v) for v in numbers):
        return "int"  # NaNs do not make an int column a float one (a NaN flood is its own anomaly)
    if all(_is_float(v) for v in values):
        return "float"
    return "string"


def _is_float(value: str) -> bool:
    return value.lower() in _NAMED_FLOATS or _FLOAT.fullmatch(value) is not None


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
