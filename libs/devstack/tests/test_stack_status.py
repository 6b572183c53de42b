"""``opml status`` finds the `make up` stack of the checkout from any of its folders."""

from __future__ import annotations

import json
import os
from pathlib import Path

from click.testing import CliRunner

from opml_devstack import stack
from opml_devstack.cli import status


def _checkout(root: Path) -> Path:
    (root / ".git").mkdir(parents=True)
    deep = root / "services" / "bundle-store" / "tests"
    deep.mkdir(parents=True)
    return deep


def test_status_finds_the_checkouts_stack_from_a_folder_inside_it(tmp_path, monkeypatch) -> None:
    deep = _checkout(tmp_path)
    stack.write_json_atomically(stack.StackConfig(state_dir=tmp_path / ".opml").state_file,
                                {"pid": os.getpid(), "parts": []})
    monkeypatch.chdir(deep)
    result = CliRunner().invoke(status, ["--json"])
    document = json.loads(result.output)
    assert document["state_file"] == str((tmp_path / ".opml" / "stack.json").resolve())
    assert document["running"] and result.exit_code == 0


def test_status_says_where_it_looked_when_no_stack_is_found(tmp_path, monkeypatch) -> None:
    deep = _checkout(tmp_path / "checkout")
    stack.write_json_atomically(stack.StackConfig(state_dir=tmp_path / ".opml").state_file,
                                {"pid": os.getpid(), "parts": []})  # above the checkout: another one's
    monkeypatch.chdir(deep)
    result = CliRunner().invoke(status, [])
    assert result.exit_code == 1
    assert (f"no .opml/stack.json in {deep.resolve()} nor any folder above it up to "
            f"{(tmp_path / 'checkout').resolve()}") in result.output
    looked = json.loads(CliRunner().invoke(status, ["--json"]).output)["looked_in"]
    assert looked[0] == str(deep.resolve()) and looked[-1] == str((tmp_path / "checkout").resolve())
