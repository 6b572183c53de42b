"""Directories only their owner may enter: a service's home, the dev stack's state.

A job the job-orchestrator runs on the same machine runs as a user of its own; what a service keeps
for itself (its outbox, the jobs' logs, the S3 server's identities and data) must not be readable by
that user. ``private_dir`` makes the folder mode 0700 whatever the umask, and narrows one that
exists already, so a home made by an earlier version with 0755 is closed too.
"""

from __future__ import annotations

import os
from pathlib import Path


def private_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` (and its missing parents) and make it mode 0700; return it.

    The parents are created with the process's umask (a home's parent, such as ``~/.opml``, is the
    operator's to choose); only ``path`` itself is narrowed.

    Raises:
        PermissionError: ``path`` exists and belongs to another user, who could read or replace what
            this process would keep there (a job that claimed the folder before the service made it).
    """
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    owner = folder.stat().st_uid
    if owner != os.geteuid():
        raise PermissionError(f"{str(folder)!r} belongs to uid {owner}, not to this process's user "
                              f"(uid {os.geteuid()}): it cannot hold this process's private files")
    folder.chmod(0o700)
    return folder


def write_private_file(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` as a file only its owner may read (mode 0600 from its creation on,
    never readable for a moment); an existing file is narrowed to 0600 and replaced."""
    target = Path(path)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb", closefd=False) as file:
            file.write(data)
    finally:
        os.close(fd)
    return target
