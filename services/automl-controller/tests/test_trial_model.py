"""A trial's model is only what lies in its own model folder: the path it names is resolved and must
stay inside, and the tree under it is regular files and folders, walked without following a symlink
(real files in a temporary folder; the service-level attack is test_service.py's)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from opml_automl_controller import trialmodel
from opml_automl_controller.trialmodel import ModelRefused, TrialFolders, confine, copy_model
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


def test_the_model_a_trial_names_in_its_folder_is_copied_with_its_layout(folders: TrialFolders,
                                                                         tmp_path: Path) -> None:
    folder = folders.of(JOB)
    assert confine(folder, "model") == "model"
    assert confine(folder, str(folder / "model")) == "model"  # absolute, but inside
    assert confine(folder, "model/../model/weights.bin") == "model/weights.bin"
    assert confine(folder, ".") == "."
    copies = tmp_path / "copies"
    files = copy_model(folder, "model", copies)
    assert {path: source.read_bytes() for path, source in files.items()} == {
        "model/vocab/words.txt": b"a b c", "model/weights.bin": b"\1\2\3"}
    assert all(source.is_relative_to(copies) for source in files.values())
    assert set(copy_model(folder, ".", tmp_path / "whole")) == {f"{JOB}/model/vocab/words.txt",
                                                                f"{JOB}/model/weights.bin"}
    assert set(copy_model(folder, "model/weights.bin", tmp_path / "one")) == {"weights.bin"}


@pytest.mark.parametrize(("named", "why"), [
    ("{secret}", "resolves outside the trial's model folder"),  # an absolute path elsewhere
    ("../../s3.json", "resolves outside the trial's model folder"),
    ("../exp-abc123-t1", "resolves outside the trial's model folder"),  # another trial's folder
    ("{other}", "resolves outside the trial's model folder"),  # the same, absolute
    ("link", "resolves outside the trial's model folder"),  # a symlink to s3.json
    ("model/leak", "holds a symlink, 'model/leak'"),  # a symlink inside the model
    ("model/hard", "holds 'model/hard', a file with other hard links"),  # s3.json itself, by another name
    ("missing", "does not exist in the trial's model folder"),
    ("", "is not a path"),
    ("empty", "holds no file"),
])
def test_a_model_path_outside_the_folder_or_through_a_symlink_is_refused(folders: TrialFolders, tmp_path: Path,
                                                                         named: str, why: str) -> None:
    folder = folders.of(JOB)
    os.symlink(tmp_path / "s3.json", folder / "link")
    if named == "model/leak":
        os.symlink(tmp_path / "s3.json", folder / "model" / "leak")
        named = "model"
    if named == "model/hard":
        os.link(tmp_path / "s3.json", folder / "model" / "hard")
        named = "model"
    (folder / "empty").mkdir()
    named = named.format(secret=tmp_path / "s3.json", other=folders.of("exp-abc123-t1"))
    with pytest.raises(ModelRefused, match=why):
        confine(folder, named)
    with pytest.raises(ModelRefused, match=why):
        copy_model(folder, named, tmp_path / "copies")
    assert not (tmp_path / "copies").exists() or "s3cr3t" not in "".join(
        p.read_text() for p in (tmp_path / "copies").rglob("*") if p.is_file())


def test_a_symlinked_folder_a_fifo_and_a_swap_after_the_check_are_refused(folders: TrialFolders,
                                                                          tmp_path: Path) -> None:
    folder = folders.of(JOB)
    os.mkfifo(folder / "model" / "pipe")
    with pytest.raises(ModelRefused, match="'model/pipe', which is not a regular file"):
        confine(folder, "model")
    os.unlink(folder / "model" / "pipe")
    assert confine(folder, "model") == "model"
    os.unlink(folder / "model" / "weights.bin")  # checked as the trial ended, swapped before the commit
    os.symlink(tmp_path / "s3.json", folder / "model" / "weights.bin")
    with pytest.raises(ModelRefused, match="holds a symlink, 'model/weights.bin'"):
        copy_model(folder, "model", tmp_path / "copies")
    moved = folders.of("exp-abc123-t9")
    folder.rename(moved)
    os.symlink(moved, folder)  # the trial's folder itself a symlink
    with pytest.raises(ModelRefused, match="the trial's model folder cannot be read without following a symlink"):
        confine(folder, ".")


def test_a_model_is_bounded_in_files_bytes_and_depth(folders: TrialFolders, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = folders.of(JOB)
    monkeypatch.setattr(trialmodel, "MAX_MODEL_FILES", 3)
    with pytest.raises(ModelRefused, match="more than 3 files and folders"):
        confine(folder, "model")  # model, weights.bin, vocab, words.txt
    monkeypatch.setattr(trialmodel, "MAX_MODEL_FILES", 10)
    monkeypatch.setattr(trialmodel, "MAX_MODEL_BYTES", 7)
    with pytest.raises(ModelRefused, match="more than 7 bytes"):
        confine(folder, "model")  # 3 + 5
    monkeypatch.setattr(trialmodel, "MAX_MODEL_BYTES", 8)
    assert confine(folder, "model") == "model"
    monkeypatch.setattr(trialmodel, "MAX_DEPTH", 1)
    with pytest.raises(ModelRefused, match="nests folders more than 1 deep"):
        confine(folder, "model")
