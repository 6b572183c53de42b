"""Reading spans: typed columns, missing values apart from NaNs, and the bounds refused before parsing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from opml_job_orchestrator.pipelines import table
from opml_job_orchestrator.pipelines.table import TableError, infer_type, numeric_matrix, read_csv_text, read_span


def test_types_are_inferred_from_the_values() -> None:
    assert infer_type(["true", "False"]) == "bool"
    assert infer_type(["1", "-2", "+3"]) == "int"
    assert infer_type(["1", "nan", "NaN"]) == "int", "NaNs do not make an int column a float one"
    assert infer_type(["1", "2.5", "1e3", "inf"]) == "float"
    assert infer_type(["1", "a"]) == "string"
    assert infer_type(["1_000"]) == "string", "Python's digit separators are not CSV numbers"
    assert infer_type([]) is None


def test_missing_cells_are_apart_from_nans() -> None:
    span = read_csv_text("x,name\n1.5,a\n,b\nnan,\n")
    x = span.column("x")
    assert x.type == "float"
    assert x.missing.tolist() == [False, True, False]
    assert x.numbers[0] == 1.5 and np.isnan(x.numbers[1]) and np.isnan(x.numbers[2])
    assert span.column("name").text == ["a", "b", None]
    assert x.text is None, "a numeric column keeps its numbers, not its text"
    assert read_csv_text("x\n1.50\n", keep_text={"x"}).column("x").text == ["1.50"]
    assert span.rows == 3


def test_a_span_of_several_files_needs_one_header(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("x,y\n1,2\n")
    (tmp_path / "b.csv").write_text("x,y\n3,4\n")
    span = read_span(tmp_path)
    assert span.rows == 2 and span.column("x").numbers.tolist() == [1.0, 3.0]
    (tmp_path / "c.csv").write_text("x,z\n5,6\n")
    with pytest.raises(TableError, match="c.csv: header"):
        read_span(tmp_path)


@pytest.mark.parametrize(("text", "message"), [
    ("", "empty file"),
    ("x,x\n1,2\n", "appears twice"),
    ("x,\n1,2\n", "column 2 has no name"),
    ("x,y\n1\n", "line 2 has 1 cells"),
])
def test_malformed_csv_is_refused_with_the_reason(text: str, message: str) -> None:
    with pytest.raises(TableError, match=message):
        read_csv_text(text)


def test_bounds_are_checked_before_the_rows_are_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(table, "MAX_ROWS", 2)
    with pytest.raises(TableError, match="more than 2 rows"):
        read_csv_text("x\n1\n2\n3\n")
    monkeypatch.setattr(table, "MAX_COLUMNS", 2)
    with pytest.raises(TableError, match="3 columns, more than 2"):
        read_csv_text("a,b,c\n1,2,3\n")
    (tmp_path / "big.csv").write_text("x\n" + "1\n" * 50)
    monkeypatch.setattr(table, "MAX_SPAN_BYTES", 10)
    with pytest.raises(TableError, match="more than 10"):
        read_span(tmp_path)
    with pytest.raises(TableError, match="no .csv file"):
        read_span(tmp_path / "nothing")


def test_numeric_matrix_marks_rows_with_a_missing_or_nan_feature() -> None:
    span = read_csv_text("a,b,s\n1,2,x\n,3,y\n4,nan,z\n5,6,w\n")
    matrix, usable = numeric_matrix(span, ["b", "a"])
    assert matrix[0].tolist() == [2.0, 1.0]
    assert usable.tolist() == [True, False, False, True]
    with pytest.raises(TableError, match=r"'s' holds text \(string\), not numbers; column 'nope' is not in"):
        numeric_matrix(span, ["s", "nope"])


def test_a_column_name_is_bounded() -> None:
    with pytest.raises(TableError, match="column 2's name has 257 characters, more than 256"):
        read_csv_text("a," + "n" * 257 + "\n1,2\n")
