"""The folders a step's job reads and writes, and reading back what it wrote without trusting it.

A step's folder is ``{pipeline_dir}/{pipeline}/{run}/{step}``: what the engine puts there for the
job (``step.json``, ``inputs/``; the train step's spans and warm-start model) is readable by
anyone (the job runs sandboxed as a user of its own), and ``outputs/`` (train: ``model/``) is
writable by anyone. ``pipeline_dir`` lies outside the service's home, which jobs cannot enter.

What a job wrote is the job's: it may have left symlinks to the service's secrets, devices, or
files that grow while read. :func:`copy_out` therefore copies only regular files, through
descriptors opened without following symlinks (each folder relative to its parent), within
bounds, into a folder of the service's own, before anything of it is read or uploaded.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from opml_common.errors import FailedPrecondition

MAX_OUTPUT_FILES = 10_000
MAX_OUTPUT_BYTES = 4 * 1024 ** 3
MAX_DEPTH = 16
MAX_RESULT_BYTES = 4 * 1024 ** 2
"""result.json is read whole: a step's verdict and metrics, never data."""


class OutputRefused(FailedPrecondition):
    """What a step's job wrote is not plain files within bounds: the step fails with this message."""


def open_pipeline_dir(root: Path) -> None:
    """Make ``root`` (the steps' folders' root) and let every user search it. A volume's root the
    service does not own (a Kubernetes claim mounted with the pod's fsGroup) may refuse the chmod:
    then it must let others in already.

    Raises:
        PermissionError: it does not, and cannot be made to.
    """
    root.mkdir(parents=True, exist_ok=True)
    try:
        root.chmod(0o755)
    except PermissionError:
        if root.stat().st_mode & 0o005 != 0o005:
            raise PermissionError(f"{root} (PIPELINE_DIR) is not searchable by other users and the service may "
                                  "not change its mode: steps' jobs could not reach their folders") from None


def step_folder(root: Path, pipeline: str, run: int, step: str) -> Path:
    return root / pipeline / str(run) / step


def make_folder(path: Path, *, writable: bool = False) -> Path:
    """``path`` and its parents under it, searchable by every user; writable by every user when asked."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o777 if writable else 0o755)
    return path


def reset_folder(path: Path) -> None:
    """Remove what an earlier, interrupted attempt left at ``path`` (a resumed run prepares it again)."""
    shutil.rmtree(path, ignore_errors=True)


def open_to_jobs(path: Path) -> None:
    """Make the tree under ``path`` readable by the step's job (folders 0755, files 0644)."""
    for folder, _dirs, files in os.walk(path):
        os.chmod(folder, 0o755)
        for name in files:
            os.chmod(os.path.join(folder, name), 0o644, follow_symlinks=False)


def write_json(path: Path, document: Any) -> None:
    path.write_text(json.dumps(document, indent=2, sort_keys=True))
    path.chmod(0o644)


def copy_out(source: Path, into: Path) -> dict[str, Path]:
    """Copy every regular file under ``source`` (a folder a job wrote) into ``into``, keeping the layout.

    Returns: relative path (``/``-separated) -> the copy.

    Raises:
        OutputRefused: a symlink or anything but a file or a folder is there, or more than
            :data:`MAX_OUTPUT_FILES` files, :data:`MAX_OUTPUT_BYTES` bytes, or :data:`MAX_DEPTH` levels.
    """
    copied: dict[str, Path] = {}
    total = [0]
    into.mkdir(parents=True, exist_ok=True)
    with _opened(os.open(source, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)) as top:
        _copy_folder(top, "", into, copied, total, 0)
    return copied


def _copy_folder(fd: int, relative: str, into: Path, copied: dict[str, Path], total: list[int], depth: int) -> None:
    if depth > MAX_DEPTH:
        raise OutputRefused(f"{relative!r} is more than {MAX_DEPTH} folders deep")
    for name in sorted(os.listdir(fd)):
        path = f"{relative}{name}"
        info = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if stat.S_ISDIR(info.st_mode):
            with _opened(os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)) as child:
                (into / path).mkdir(exist_ok=True)
                _copy_folder(child, path + "/", into, copied, total, depth + 1)
            continue
        if not stat.S_ISREG(info.st_mode):
            raise OutputRefused(f"the step's output {path!r} is not a regular file (a symlink, a device...); "
                                "a step writes plain files only")
        if len(copied) >= MAX_OUTPUT_FILES:
            raise OutputRefused(f"the step wrote more than {MAX_OUTPUT_FILES} files")
        with _opened(os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)) as src:
            if not stat.S_ISREG(os.fstat(src).st_mode):
                raise OutputRefused(f"the step's output {path!r} is not a regular file")
            target = into / path
            with open(target, "wb") as out:
                while chunk := os.read(src, 1024 * 1024):
                    total[0] += len(chunk)
                    if total[0] > MAX_OUTPUT_BYTES:
                        raise OutputRefused(f"the step wrote more than {MAX_OUTPUT_BYTES} bytes")
                    out.write(chunk)
        copied[path] = target


def read_result(folder: Path) -> dict[str, Any]:
    """``folder/result.json`` (a copy :func:`copy_out` made) as a mapping.

    Raises:
        OutputRefused: it is missing, too big, not JSON, or not a mapping.
    """
    path = folder / "result.json"
    if not path.is_file():
        raise OutputRefused("the step's job succeeded but wrote no outputs/result.json")
    if path.stat().st_size > MAX_RESULT_BYTES:
        raise OutputRefused(f"outputs/result.json is larger than {MAX_RESULT_BYTES} bytes")
    try:
        result = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise OutputRefused(f"outputs/result.json is not JSON: {exc}") from None
    if not isinstance(result, dict):
        raise OutputRefused("outputs/result.json must be a JSON object")
    return result


@contextlib.contextmanager
def _opened(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)
