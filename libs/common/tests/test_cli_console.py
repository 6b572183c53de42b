"""Command output into a pipe keeps whole lines, whatever width the environment claims."""

from __future__ import annotations

import io
import sys

from rich.table import Table

from opml_common.cligroup import PIPE_WIDTH, output_console


def test_a_pipe_gets_whole_lines_even_when_columns_says_80(monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")  # what pytest-xdist workers and many CI runners set
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    console = output_console()
    assert console.width == PIPE_WIDTH
    table = Table()
    for column in ("worker", "session", "state", "steps", "batches", "missing", "examples/s", "signature"):
        table.add_column(column)
    table.add_row("worker-0", "s1", "running", "3", "2", "0", "80.0", "keras.fit x3 (266.67 ms)")
    console.print(table)
    assert "worker-0" in sys.stdout.getvalue() and "keras.fit x3 (266.67 ms)" in sys.stdout.getvalue()
