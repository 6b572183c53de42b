"""Each trial's own folder: its job's checkpoint folder, where it may keep its checkpoints and model files.

Every trial gets a folder of its own, ``{root}/{job id}``: the trial's job's checkpoint folder, which the
job-orchestrator makes for the job's user (a sandboxed job runs as a user of its own, who must be able
to write it), named to the trial in :data:`MODEL_DIR_VARIABLE`. The controller never reads what is in
it: a trial uploads its model itself, through the bundle-store's API with an upload grant of its own
(:mod:`.models`, :func:`opml_automl_controller.sdk.save_model`). The root (:meth:`TrialFolders.open`)
is the controller's, outside its home (mode 0700: no job's user may enter it), mode 0711, so a job's
user passes through it to its own folder, lists no other, and makes nothing in it; an experiment's
folders are removed with it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from pathlib import Path

from opml_common.errors import FailedPrecondition

TRIALS_DIR_SETTING = "OPML_AUTOML_CONTROLLER_TRIALS_DIR"
ROOT_MODE = 0o711
"""The trials' root: a job's user may pass through it to its own folder, and neither list it nor make anything in it."""
MODEL_DIR_VARIABLE = "AUTOML_MODEL_DIR"
"""The variable that names a trial's model folder in its job (the orchestrator keeps ``OPML_*`` its own)."""


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
