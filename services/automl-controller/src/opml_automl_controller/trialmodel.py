"""Each trial's own model folder, and the model the controller reads from it, confined to it.

A trial says where its model is with one line of its log (:func:`opml_automl_controller.sdk.save_model`),
and a log line is the trial's to write: it could name the controller's own ``s3.json``, a symlink to
it, or another job's folder, and the controller, which reads what it commits with its own rights,
would upload that file for any reader of the bundle-store. So every trial gets a folder of its own,
``{root}/{job id}``: the trial's job's checkpoint folder, which the job-orchestrator makes for the
job's user (a sandboxed job runs as a user of its own, who must be able to write it), named to the
trial in :data:`MODEL_DIR_VARIABLE`. The root (:meth:`TrialFolders.open`) is the controller's, outside
its home (mode 0700: no job's user may enter it), mode 0711, so a job's user passes through it to its
own folder, lists no other, and makes nothing in it. The path a trial names is taken relative to its
folder, and its model is only what lies inside it: the named path must resolve inside the folder (an
absolute path elsewhere, a ``..`` out, a symlink leading out are refused), and the tree under it is
walked without following any symlink (directories opened with ``O_NOFOLLOW`` relative to their
parent, files with ``O_NOFOLLOW``, each checked regular with ``fstat``): a symlink anywhere in it, a
FIFO, socket or device, a file with another hard link (which is that other file), more than
:data:`MAX_MODEL_FILES` files or :data:`MAX_MODEL_BYTES` bytes refuse the model (:class:`ModelRefused`,
naming why). What is committed is copied from the descriptors so opened into
a folder of the controller's, so nothing the trial changes after the check is read. The folder and its
files belong to the job's user; that is expected, and changes none of these checks.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from opml_common.errors import FailedPrecondition

TRIALS_DIR_SETTING = "OPML_AUTOML_CONTROLLER_TRIALS_DIR"
ROOT_MODE = 0o711
"""The trials' root: a job's user may pass through it to its own folder, and neither list it nor make anything in it."""
MODEL_DIR_VARIABLE = "AUTOML_MODEL_DIR"
"""The variable that names a trial's model folder in its job (the orchestrator keeps ``OPML_*`` its own)."""
MAX_MODEL_FILES = 10_000
"""Files (and folders) a model may hold."""
MAX_MODEL_BYTES = 4 * 1024**3
"""Bytes a model may hold, all its files together."""
MAX_DEPTH = 32
"""Folders a model may nest."""
_COPY_CHUNK = 1024 * 1024


class ModelRefused(FailedPrecondition):
    """A trial's model is not committed; the message says why (never the content of any file)."""


class TrialFolders:
    """Where each trial's model folder is: ``{root}/{job id}`` (a job id holds no ``/``), made by the
    job-orchestrator as the trial's job's checkpoint folder, not by the controller."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @classmethod
    def open(cls, root: Path) -> TrialFolders:
        """The trials' ``root``, made if it is not there, and made mode :data:`ROOT_MODE`.

        Raises:
            FailedPrecondition: ``root`` is a symlink or no folder, belongs to another user (a job's user
                who made it first would own every trial's folder), or a folder above it may be changed by
                a user other than root and this process's (who could put another folder in its place).
        """
        root.parent.mkdir(parents=True, exist_ok=True)
        parent = Path(os.path.realpath(root.parent))
        for above in (parent, *parent.parents):
            info = os.stat(above)
            if info.st_uid not in (0, os.geteuid()) or (info.st_mode & stat.S_IWOTH
                                                        and not info.st_mode & stat.S_ISVTX):
                raise FailedPrecondition(f"the trials' folder {str(root)!r} ({TRIALS_DIR_SETTING}) is in "
                                         f"{str(above)!r} (uid {info.st_uid}, mode "
                                         f"{stat.S_IMODE(info.st_mode):04o}), which a user other than root "
                                         f"and this process's may change")
        with contextlib.suppress(FileExistsError):
            os.mkdir(root, ROOT_MODE)
        try:
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as error:  # ELOOP: a symlink; ENOTDIR: a file
            raise FailedPrecondition(f"the trials' folder {str(root)!r} ({TRIALS_DIR_SETTING}) cannot be "
                                     f"opened as a folder without following a symlink "
                                     f"({os.strerror(error.errno or 0)})") from None
        try:
            owner = os.fstat(fd).st_uid
            if owner != os.geteuid():
                raise FailedPrecondition(f"the trials' folder {str(root)!r} ({TRIALS_DIR_SETTING}) belongs to "
                                         f"uid {owner}, not to this process's user (uid {os.geteuid()})")
            os.fchmod(fd, ROOT_MODE)
        finally:
            os.close(fd)
        return cls(root)

    def of(self, job_id: str) -> Path:
        return self.root / job_id

    def remove(self, job_ids: list[str]) -> None:
        """The folders of these trials and what is in them (their experiment was deleted)."""
        for job_id in job_ids:
            shutil.rmtree(self.of(job_id), ignore_errors=True)


def confine(folder: Path, named: str) -> str:
    """The path a trial named, as a path relative to its folder (``.``: the folder itself), once its
    model there is checked as :func:`copy_model` would read it.

    Raises:
        ModelRefused: the path is empty, resolves outside the folder or does not exist, or the model
            breaks a rule of :func:`copy_model`.
    """
    relative = _relative(folder, named)
    _read(folder, relative, into=None)
    return relative


def copy_model(folder: Path, relative: str, into: Path) -> dict[str, Path]:
    """Copy the model at ``relative`` in the trial's ``folder`` into ``into``: every regular file under
    it (itself, if it is a file), read through descriptors opened without following symlinks.

    Returns: bundle path -> the copy; a folder keeps its layout under its own name (the trial's
    folder itself under the folder's name, the job id).

    Raises:
        ModelRefused: the path leaves the folder or does not exist; a symlink, or anything but a regular
            file or a folder, under it; no file; more than :data:`MAX_MODEL_FILES` files, or
            :data:`MAX_MODEL_BYTES` bytes, or :data:`MAX_DEPTH` folders deep.
    """
    return _read(folder, _relative(folder, relative), into=into)


def _relative(folder: Path, named: str) -> str:
    if not named or "\0" in named:
        raise ModelRefused(f"the model path {_shown(named)} is not a path")
    base = os.path.realpath(folder)
    target = os.path.realpath(os.path.join(base, named))  # an absolute path stands alone; symlinks are resolved
    if target != base and not target.startswith(base + os.sep):
        raise ModelRefused(f"the model path {_shown(named)} resolves outside the trial's model folder "
                           f"({MODEL_DIR_VARIABLE}); only what the trial wrote there is committed")
    return os.path.relpath(target, base)


def _read(folder: Path, relative: str, *, into: Path | None) -> dict[str, Path]:
    """The model's files, walked (and copied when ``into`` is given) with descriptors only."""
    parts = [part for part in Path(relative).parts if part != "."]
    walk = _Walk(into)
    with _opened_dir(str(folder), None, ".") as top:
        parent, name = top, folder.name
        opened = []
        try:
            for index, part in enumerate(parts):
                name = part
                if index == len(parts) - 1:
                    break
                parent = _open(part, parent, os.O_DIRECTORY, "/".join(parts[:index + 1]))
                opened.append(parent)
            if parts:
                walk.entry(parent, name, "/".join(parts), bundle_path=name, depth=0)
            else:
                walk.folder(top, relative_to_trial="", bundle_path=name, depth=0)
        finally:
            for fd in reversed(opened):
                os.close(fd)
    if not walk.files:
        raise ModelRefused(f"the model path {_shown(relative)} holds no file")
    return walk.files


class _Walk:
    """Counts (and copies) the regular files under a model, refusing anything else."""

    def __init__(self, into: Path | None) -> None:
        self.into = into
        self.files: dict[str, Path] = {}
        self.entries = 0
        self.bytes = 0

    def entry(self, parent: int, name: str, where: str, *, bundle_path: str, depth: int) -> None:
        self.entries += 1
        if self.entries > MAX_MODEL_FILES:
            raise ModelRefused(f"the model holds more than {MAX_MODEL_FILES} files and folders")
        try:
            mode = os.lstat(name, dir_fd=parent).st_mode
        except FileNotFoundError:
            raise ModelRefused(f"the model path {_shown(where)} does not exist in the trial's model folder") from None
        if stat.S_ISLNK(mode):
            raise ModelRefused(f"the model holds a symlink, {_shown(where)}; a model is regular files only")
        if stat.S_ISDIR(mode):
            if depth >= MAX_DEPTH:
                raise ModelRefused(f"the model nests folders more than {MAX_DEPTH} deep ({_shown(where)})")
            with _opened_dir(name, parent, where) as fd:
                self.folder(fd, relative_to_trial=where, bundle_path=bundle_path, depth=depth + 1)
        elif stat.S_ISREG(mode):
            self.file(parent, name, where, bundle_path)
        else:
            raise ModelRefused(f"the model holds {_shown(where)}, which is not a regular file")

    def folder(self, fd: int, *, relative_to_trial: str, bundle_path: str, depth: int) -> None:
        with os.scandir(fd) as entries:
            names = sorted(entry.name for entry in entries)
        for name in names:
            where = f"{relative_to_trial}/{name}" if relative_to_trial else name
            self.entry(fd, name, where, bundle_path=f"{bundle_path}/{name}", depth=depth)

    def file(self, parent: int, name: str, where: str, bundle_path: str) -> None:
        fd = _open(name, parent, os.O_RDONLY | os.O_NONBLOCK, where)  # a FIFO swapped in is refused, not waited on
        with os.fdopen(fd, "rb") as source:
            info = os.fstat(source.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise ModelRefused(f"the model holds {_shown(where)}, which is not a regular file")
            if info.st_nlink > 1:  # a hard link to a file elsewhere is that file
                raise ModelRefused(f"the model holds {_shown(where)}, a file with other hard links; a model is "
                                   f"files of its own")
            self.bytes += info.st_size
            if self.bytes > MAX_MODEL_BYTES:
                raise ModelRefused(f"the model holds more than {MAX_MODEL_BYTES} bytes")
            if self.into is None:
                self.files[bundle_path] = Path(where)
                return
            target = self.into / bundle_path
            target.parent.mkdir(parents=True, exist_ok=True)
            copied = 0
            with target.open("wb") as sink:
                while chunk := source.read(_COPY_CHUNK):
                    copied += len(chunk)
                    if copied > info.st_size:  # it grew after the check: it is still being written
                        raise ModelRefused(f"the model file {_shown(where)} changed while it was read")
                    sink.write(chunk)
            self.files[bundle_path] = target


def _open(name: str, parent: int | None, flags: int, where: str) -> int:
    try:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    except FileNotFoundError:
        if where == ".":
            raise ModelRefused("the trial's model folder does not exist") from None
        raise ModelRefused(f"the model path {_shown(where)} does not exist in the trial's model folder") from None
    except OSError as error:  # ELOOP: a symlink; ENOTDIR: a file on the way
        what = "the trial's model folder" if where == "." else f"the model path {_shown(where)}"
        raise ModelRefused(f"{what} cannot be read without following a symlink "
                           f"({os.strerror(error.errno or 0)})") from None


@contextmanager
def _opened_dir(name: str, parent: int | None, where: str) -> Iterator[int]:
    fd = _open(name, parent, os.O_RDONLY | os.O_DIRECTORY, where)
    try:
        yield fd
    finally:
        os.close(fd)


def _shown(path: str) -> str:
    return repr(path[:200]) + ("..." if len(path) > 200 else "")
