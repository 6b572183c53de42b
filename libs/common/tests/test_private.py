"""Private folders and files: what a service keeps must not be readable by the jobs beside it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from opml_common.private import private_dir, write_private_file


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_a_private_dir_is_0700_whatever_the_umask_and_an_open_one_is_narrowed(tmp_path: Path) -> None:
    previous = os.umask(0)
    try:
        home = private_dir(tmp_path / "opml" / "service")
        assert mode(home) == 0o700 and mode(home.parent) == 0o777  # the parent is the umask's
        (tmp_path / "open").mkdir(mode=0o755)
        assert mode(private_dir(tmp_path / "open")) == 0o700
    finally:
        os.umask(previous)


def test_a_folder_another_user_owns_is_refused(tmp_path: Path) -> None:
    taken = tmp_path / "taken"
    taken.mkdir()
    os.chown(taken, 2_999_999, 2_999_999)  # a job's user made it first
    with pytest.raises(PermissionError, match="belongs to uid 2999999"):
        private_dir(taken)


def test_a_private_file_is_0600_from_its_creation_and_replaces_a_readable_one(tmp_path: Path) -> None:
    path = write_private_file(tmp_path / "s3.json", b"{}")
    assert mode(path) == 0o600 and path.read_bytes() == b"{}"
    path.chmod(0o644)
    assert mode(write_private_file(path, b"[]")) == 0o600 and path.read_bytes() == b"[]"
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):
        write_private_file(tmp_path / "link", b"x")  # never written through a link
    assert not (tmp_path / "elsewhere").exists()
