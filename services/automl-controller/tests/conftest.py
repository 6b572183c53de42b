"""Fixtures every automl-controller test file that starts the service uses."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def trials_dir() -> Iterator[Path]:
    """The controller's trials' folder (``OPML_AUTOML_CONTROLLER_TRIALS_DIR``), this test's own: in the
    system's temporary folder (sticky, as the default's /var/tmp is), where every job's user reaches it;
    tmp_path is the test's user's alone."""
    folder = Path(tempfile.mkdtemp(prefix="opml-automl-trials-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)
