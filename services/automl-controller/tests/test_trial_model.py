"""A trial's model is only what lies in its own model folder: the path it names is resolved and must
stay inside, and the tree under it is regular files and folders, walked without following a symlink
(real files in a temporary folder; the service-level attack is test_service.py's)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from opml_automl_controller import trialmodel
from opml_automl_controller.trialmodel import ModelRefused, TrialFolders, confine, copy_model

JOB = "exp-abc123-t0"


@pytest.fixture
def folders(tmp_path: Path) -> TrialFolders:
    """Two trials' folders under the controller's home, and the controller's S3 identities beside them."""
    (tmp_path / "s3.json").write_text('{"identities": [{"credentials": [{"secretKey": "s3cr3t"}]}]}')
    folders = TrialFolders(tmp_path / "home" / "trials")
    mine = folders.make(JOB)
    (mine / "model").mkdir()
    (mine / "model" / "weights.bin").write_bytes(b"\1\2\3")
    (mine / "model" / "vocab").mkdir()
    (mine / "model" / "vocab" / "words.txt").write_text("a b c")
    other = folders.make("exp-abc123-t1")
    (other / "worker-0.log").write_text("another trial's log")
    return folders


def test_a_trials_folder_is_its_own_and_private(folders: TrialFolders) -> None:
    folder = folders.of(JOB)
    assert folder == folders.root / JOB and folders.make(JOB) == folder  # made again: found as it is
    assert folder.stat().st_mode & 0o777 == 0o700 and folders.root.stat().st_mode & 0o777 == 0o700
    folders.remove([JOB])
    assert not folder.exists() and folders.of("exp-abc123-t1").exists()


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
