"""Each trial's own folder (its job's checkpoint folder): the root lets job users through to their own
folders and lists none, and an experiment's folders are removed with it (real folders; a trial's model
is uploaded by the trial itself, test_models.py and test_service.py)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from opml_automl_controller.trialmodel import TrialFolders
from opml_common.errors import FailedPrecondition

JOB = "exp-abc123-t0"
JOB_UID = 2_000_123
"""The uid a sandboxed trial's job runs as: its folder and files are that user's."""


def job_owned(folder: Path) -> None:
    """``folder`` and everything in it made the job user's, as a sandboxed job leaves them."""
    for path in (folder, *folder.rglob("*")):
        os.chown(path, JOB_UID, JOB_UID, follow_symlinks=False)


@pytest.fixture
def folders(tmp_path: Path) -> TrialFolders:
    """Two trials' folders (made as the orchestrator makes a job's checkpoint folder, then written by
    the job's user), and the controller's S3 identities beside them."""
    (tmp_path / "s3.json").write_text('{"identities": [{"credentials": [{"secretKey": "s3cr3t"}]}]}')
    folders = TrialFolders.open(tmp_path / "trials")
    mine = folders.of(JOB)
    mine.mkdir(mode=0o700)
    (mine / "model").mkdir()
    (mine / "model" / "weights.bin").write_bytes(b"\1\2\3")
    (mine / "model" / "vocab").mkdir()
    (mine / "model" / "vocab" / "words.txt").write_text("a b c")
    other = folders.of("exp-abc123-t1")
    other.mkdir(mode=0o700)
    (other / "worker-0.log").write_text("another trial's log")
    job_owned(mine)
    job_owned(other)
    return folders


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_the_trials_root_lets_job_users_through_to_their_folders_and_lists_nothing(tmp_path: Path) -> None:
    previous = os.umask(0o077)
    try:
        folders = TrialFolders.open(tmp_path / "made" / "trials")
    finally:
        os.umask(previous)
    assert mode(folders.root) == 0o711 and folders.of(JOB) == folders.root / JOB  # whatever the umask
    (tmp_path / "open").mkdir(mode=0o777)
    assert mode(TrialFolders.open(tmp_path / "open").root) == 0o711  # an earlier, listable one is narrowed
    (tmp_path / "sticky").mkdir()
    (tmp_path / "sticky").chmod(0o1777)  # /var/tmp's and /tmp's mode: others cannot move what is not theirs
    assert mode(TrialFolders.open(tmp_path / "sticky" / "trials").root) == 0o711


def test_a_trials_root_a_job_user_could_own_or_replace_is_refused(tmp_path: Path) -> None:
    """A symlink, a folder a job's user made first, or one in a folder others may change (where a job's
    user could move it away and put its own in its place): the controller does not start."""
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "file").write_text("")
    (tmp_path / "taken").mkdir()
    os.chown(tmp_path / "taken", 2_999_999, 2_999_999)
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared").chmod(0o777)
    (tmp_path / "theirs").mkdir()
    os.chown(tmp_path / "theirs", 2_999_999, 2_999_999)
    refused = {"link": "cannot be opened as a folder without following a symlink",
               "file": "cannot be opened as a folder without following a symlink (Not a directory)",
               "taken": "belongs to uid 2999999, not to this process's user",
               "shared/trials": f"is in {str(tmp_path / 'shared')!r} (uid {os.geteuid()}, mode 0777), which a user "
                                f"other than root and this process's may change",
               "theirs/trials": f"is in {str(tmp_path / 'theirs')!r} (uid 2999999, mode"}
    for name, why in refused.items():
        with pytest.raises(FailedPrecondition, match="OPML_AUTOML_CONTROLLER_TRIALS_DIR") as caught:
            TrialFolders.open(tmp_path / name)
        assert why in caught.value.message, (name, caught.value.message)
    assert not (tmp_path / "shared" / "trials").exists() and mode(tmp_path / "real") != 0o711


def test_an_experiments_trial_folders_are_removed_though_their_jobs_users_own_them(folders: TrialFolders) -> None:
    folders.remove([JOB])
    assert not folders.of(JOB).exists() and folders.of("exp-abc123-t1").exists()
