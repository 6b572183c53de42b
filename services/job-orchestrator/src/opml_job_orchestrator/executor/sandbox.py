"""The local executor's sandbox: each job's tasks run as a user of their own, who can read no service's
secrets and write none of the platform's code or data.

A job runs whatever its submitter wrote. Run as the service's user, it could read every service's
``/proc/<pid>/environ`` (tokens, S3 keys), their homes, and write the platform's code. Sandboxed:

- **A user of its own.** Every job gets a uid from ``[uid_base, uid_base + uid_count)`` (gid the same,
  no supplementary group), recorded in ``{work_dir}/{job_id}/sandbox-uid`` the first time it runs, so
  each of its attempts and resumes runs as the same user and reads its own checkpoints, and no two
  jobs ever share one. Those uids own nothing of the platform's: the services' homes are mode 0700
  (``opml_common.private``), the venv and the checkout belong to root and are not writable by others,
  and another uid's ``/proc/<pid>/environ`` is unreadable to it.
- **Its own view of the machine** (``sandbox_exec``, run as the task's process before the command):
  a mount namespace where ``/proc`` lists only its own user's processes (``hidepid=invisible``),
  where the run's sandbox folder is at :data:`MOUNT_POINT`, and where the Python the executor runs
  on is visible read-only when it lives in a folder the job's user cannot enter (pyenv's, under
  ``/root``: that folder shows only it); ``no_new_privs``; umask 077.
- **Its own folders.** The run's sandbox folder, ``{run_dir}/sandbox`` (the job's, 0700), holds one
  folder per task, its working directory and ``HOME`` (``worker-0/``), with its ``TMPDIR`` in it
  (``worker-0/tmp``); the task's heartbeat file (``worker-0.heartbeat``); and the run's trace spool
  (``trace-spool/``), where its tracers write and from which a shipper running as the same job user
  publishes, so no job reads or forges another's trace events and the service never reads a folder
  a job controls. The logs and the run manifest stay the service's, beside that folder: a task's log
  is opened by the executor (append-only) and given to it as stdout.
- **A checkpoint folder of its own.** ``checkpoint_dir`` is made for the job's user when it does not
  exist; one that exists must already be the job user's (made for an earlier attempt); it must be
  absolute, outside the platform's folders (the service's home and work dir, the Python installation
  and every folder on ``sys.path``, the system's) and reachable by the job's user (every folder above
  it searchable). Otherwise the run does not start, and its failure says why.

``/tmp``, ``/var/tmp`` and ``/dev/shm`` stay the machine's shared sticky folders, so a path given to a
job (a model folder, a checkpoint folder) means the same inside and outside; the job's own temporary
files go to its ``TMPDIR`` and are private by its umask.

``mode`` (the ``SANDBOX`` setting): ``auto`` sandboxes when the service runs as root (it must be, to
switch users and mount) and the sandbox works here (a probe runs ``true`` in it at start), else runs
jobs as the service's user and logs a warning saying why; ``required`` refuses to start instead;
``off`` runs jobs as the service's user, in its working directory, as before the sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pwd
import shutil
import stat
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from opml_common.errors import FailedPrecondition, InvalidArgument

logger = logging.getLogger(__name__)

SANDBOX_MODES = ("auto", "required", "off")
MOUNT_POINT = Path("/run/opml-job")
"""Where a task sees its run's sandbox folder (an empty folder on the machine, a mount point only)."""
DEFAULT_UID_BASE = 2_000_000
DEFAULT_UID_COUNT = 100_000
MAX_UID = 2**32 - 2  # (uid_t)-1 means "unchanged" to the kernel
UID_FILE = "sandbox-uid"
SANDBOX_FOLDER = "sandbox"
TRACE_SPOOL = "trace-spool"
HELPER_COMMAND = (sys.executable, "-I", "-S", str(Path(__file__).with_name("sandbox_exec.py")))
"""The helper runs as root before the command: isolated (no PYTHON* variable, no user site) and with no
site-packages (the standard library only), with an empty environment."""
SYSTEM_DIRS = tuple(Path(p) for p in ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32",
                                      "/proc", "/root", "/run", "/sbin", "/sys", "/usr", "/var/lib", "/var/spool"))
"""Folders where a checkpoint folder is never made: a folder the job's user owns there could be read as
configuration by the system (``/etc/systemd/system/x.service.d``)."""
_MAX_STATUS_BYTES = 64 * 1024


def privileged() -> bool:
    """Whether this process can switch users and mount (it runs as root)."""
    return os.geteuid() == 0


class CouldNotStart(Exception):
    """The task cannot start in its sandbox (a checkpoint folder refused, a command not found); the
    message says why, for the run's failure."""


def check_settings(mode: object, uid_base: object, uid_count: object) -> None:
    """Raise InvalidArgument naming every bad sandbox setting."""
    violations = []
    if mode not in SANDBOX_MODES:
        violations.append(("sandbox", f"`sandbox` must be one of {', '.join(SANDBOX_MODES)}, but got {mode!r}."))
    for name, value in (("sandbox_uid_base", uid_base), ("sandbox_uid_count", uid_count)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            violations.append((name, f"`{name}` must be an integer >= 1, but got {value!r}."))
    if not violations and uid_base + uid_count - 1 > MAX_UID:  # type: ignore[operator]
        violations.append(("sandbox_uid_count", f"`sandbox_uid_base` + `sandbox_uid_count` - 1 must be at most "
                                                f"{MAX_UID}, but got {uid_base + uid_count - 1}."))  # type: ignore[operator]
    if violations:
        raise InvalidArgument.of(violations)


def hidden_folders(paths: Iterable[str | os.PathLike[str]]) -> list[tuple[str, str]]:
    """Of ``paths`` (folders, links resolved), those a user who is neither owner nor group of the folders
    above them cannot reach, each with the highest of those folders that stops such a user: what a
    sandbox lays an empty tmpfs over, to show ``path`` alone in it. A path inside another is left out."""
    found: list[tuple[str, str]] = []
    for path in sorted({os.path.realpath(p) for p in paths}):
        if any(path == shown or path.startswith(shown + "/") for shown, _ in found):
            continue
        above = Path(path).parent
        blocking = [folder for folder in (*reversed(above.parents), above)
                    if folder != Path("/") and not os.stat(folder).st_mode & stat.S_IXOTH]
        if blocking:
            found.append((path, str(blocking[0])))
    return found


@dataclass(frozen=True)
class RunSandbox:
    """One run's sandbox folder: ``root`` as the executor sees it, :data:`MOUNT_POINT` as its tasks do;
    ``expose`` the folders the sandbox shows though the job's user could not reach them (:func:`hidden_folders`)."""

    uid: int
    root: Path
    expose: tuple[tuple[str, str], ...] = ()

    def heartbeat(self, role: str, index: int) -> Path:
        return self.root / f"{role}-{index}.heartbeat"

    @property
    def trace_spool(self) -> Path:
        return self.root / TRACE_SPOOL

    def task_env(self, role: str, index: int) -> dict[str, str]:
        """What a task is told of its folders, as it sees them (over what the job's env says): its trace
        spool is the run's, traced or not (a tracer the job runs itself spools there too)."""
        home = f"{MOUNT_POINT}/{role}-{index}"
        return {"HOME": home, "TMPDIR": f"{home}/tmp", "OPML_HEARTBEAT_FILE": f"{MOUNT_POINT}/{role}-{index}.heartbeat",
                "OPML_TRACE_SPOOL_DIR": f"{MOUNT_POINT}/{TRACE_SPOOL}"}

    def task_cwd(self, role: str, index: int) -> str:
        return f"{MOUNT_POINT}/{role}-{index}"

    def shipper_env(self) -> dict[str, str]:
        return {"HOME": str(MOUNT_POINT), "OPML_TRACE_SPOOL_DIR": f"{MOUNT_POINT}/{TRACE_SPOOL}"}

    async def spawn(self, argv: Sequence[str], env: Mapping[str, str], *, cwd: str, stdout: IO[bytes],
                    created: Callable[[int], None] = lambda pid: None) -> asyncio.subprocess.Process:
        """Start ``argv`` as the run's user in its sandbox (see ``sandbox_exec``), in a session of its own;
        ``created(pid)`` is called once the helper's process exists, before it is given its config (it
        runs nothing of the job's before that).

        Raises:
            CouldNotStart: the sandbox could not be entered or the command not run (the reason).
            OSError: the helper itself could not start.
        """
        read_fd, write_fd = os.pipe()
        try:
            try:
                process = await asyncio.create_subprocess_exec(
                    *HELPER_COMMAND, stdin=asyncio.subprocess.PIPE, stdout=stdout, stderr=asyncio.subprocess.STDOUT,
                    env={}, start_new_session=True, pass_fds=(write_fd,))
            finally:
                os.close(write_fd)
            created(process.pid)
            assert process.stdin is not None
            process.stdin.write(self._config(argv, env, cwd=cwd, status_fd=write_fd))
            with contextlib.suppress(ConnectionError):  # it died early: its status says why
                await process.stdin.drain()
            process.stdin.close()
            reason = await asyncio.to_thread(_read_status, read_fd)
        finally:
            os.close(read_fd)
        if reason:
            await process.wait()
            raise CouldNotStart(reason)
        return process

    def _config(self, argv: Sequence[str], env: Mapping[str, str], *, cwd: str, status_fd: int) -> bytes:
        return json.dumps({"uid": self.uid, "gid": self.uid, "sandbox": str(self.root),
                           "mount_point": str(MOUNT_POINT), "expose": [list(e) for e in self.expose], "cwd": cwd,
                           "argv": list(argv), "env": dict(env), "status_fd": status_fd}).encode()


class Sandbox:
    """The executor's sandboxing (see the module's docstring): each job's uid, each run's folders, the
    checkpoint folders it hands to jobs. Made by :meth:`open`; its methods block (run them in a thread)."""

    def __init__(self, *, work_dir: Path, uids: range, protected: Iterable[Path],
                 expose: Sequence[tuple[str, str]]) -> None:
        self._work_dir = work_dir
        self._uids = uids
        self._expose = tuple(expose)
        self._protected = tuple(dict.fromkeys(Path(os.path.realpath(p)) for p in protected))
        self._by_job: dict[str, int] = {}
        self._allocating = threading.Lock()  # launches prepare their runs in threads

    @classmethod
    def open(cls, mode: str, *, work_dir: Path, uid_base: int, uid_count: int,
             protected: Iterable[str | os.PathLike[str]] = ()) -> Sandbox | None:
        """The sandbox ``mode`` asks for, or None when jobs run unsandboxed (``off``, or ``auto`` where
        it cannot be had, with a warning saying why). ``work_dir`` exists. ``protected`` adds the
        service's own folders to those a checkpoint folder may not be in.

        Raises:
            FailedPrecondition: ``required``, and the sandbox cannot be had here (the reason), or the uid
                range holds a user of the machine's (either mode).
        """
        check_settings(mode, uid_base, uid_count)
        if mode == "off":
            return None
        uids = range(uid_base, uid_base + uid_count)
        taken = sorted({user.pw_name for user in pwd.getpwall() if user.pw_uid in uids})
        if taken:
            raise FailedPrecondition(f"the jobs' uid range {uid_base}..{uids[-1]} (sandbox_uid_base, "
                                     f"sandbox_uid_count) holds users of this machine: {', '.join(taken)}; a job "
                                     "would run as one of them. Move the range.")
        expose = hidden_folders([sys.base_prefix, sys.prefix, sys.exec_prefix,
                                 os.path.dirname(os.path.realpath(sys.executable))])
        why_not = "the service does not run as root (it must, to run each job as a user of its own)"
        if privileged():
            why_not = _probe(RunSandbox(uid_base, work_dir / ".sandbox-probe", tuple(expose)))
        if why_not is not None:
            if mode == "required":
                raise FailedPrecondition(f"the job sandbox is required (sandbox=required), but {why_not}.")
            logger.warning("jobs run unsandboxed, as this service's user: %s (sandbox=auto; set sandbox=required "
                           "to refuse to start instead)", why_not)
            return None
        platform = [work_dir, Path.cwd(), Path(sys.prefix), Path(sys.base_prefix), Path(sys.exec_prefix),
                    *(Path(p) for p in sys.path if p and os.path.isdir(p))]
        sandbox = cls(work_dir=work_dir, uids=uids, protected=[*SYSTEM_DIRS, *platform, *map(Path, protected)],
                      expose=expose)
        sandbox._load()
        return sandbox

    def _load(self) -> None:
        """Read the uids recorded for the jobs in ``work_dir``."""
        for job_dir in self._work_dir.iterdir():
            with contextlib.suppress(OSError, ValueError):
                uid = int((job_dir / UID_FILE).read_text())
                if uid in self._uids:
                    self._by_job[job_dir.name] = uid

    def uid_of(self, job_id: str) -> int:
        """``job_id``'s uid: the one recorded for it, else the lowest no job has (then recorded).

        Raises:
            FailedPrecondition: every uid of the range is some job's.
        """
        with self._allocating:
            return self._by_job.get(job_id) or self._allocate(job_id)

    def _allocate(self, job_id: str) -> int:
        used = set(self._by_job.values())
        uid = next((u for u in self._uids if u not in used), None)
        if uid is None:
            raise FailedPrecondition(f"every uid of the jobs' range ({len(self._uids)}, sandbox_uid_count) is a "
                                     "job's already; raise sandbox_uid_count")
        job_dir = self._work_dir / job_id
        job_dir.mkdir(parents=True, exist_ok=True)
        partial = job_dir / f".{UID_FILE}.partial"
        partial.write_text(str(uid))
        os.replace(partial, job_dir / UID_FILE)
        self._by_job[job_id] = uid
        return uid

    def prepare(self, job_id: str, run_dir: Path, tasks: Iterable[tuple[str, int]], *,
                checkpoint_dir: str | None) -> RunSandbox:
        """Make run ``run_dir``'s sandbox folder for ``tasks`` and its trace spool, all the job user's,
        and hand ``checkpoint_dir`` to that user (see the module's docstring).

        Raises:
            CouldNotStart: the checkpoint folder is refused (why), or no uid is left.
            OSError: a folder could not be made (a full disk).
        """
        try:
            uid = self.uid_of(job_id)
        except FailedPrecondition as exc:
            raise CouldNotStart(str(exc)) from None
        if checkpoint_dir is not None:
            claim_dir(checkpoint_dir, uid, self._protected, field="checkpoint.dir")
        run = RunSandbox(uid, run_dir / SANDBOX_FOLDER, self._expose)
        _own_dir(run.root, uid)
        for role, index in tasks:
            _own_dir(run.root / f"{role}-{index}", uid)
            _own_dir(run.root / f"{role}-{index}" / "tmp", uid)
            fd = os.open(run.heartbeat(role, index), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                os.fchown(fd, uid, uid)
            finally:
                os.close(fd)
        _own_dir(run.trace_spool, uid)
        return run


def _own_dir(path: Path, uid: int) -> None:
    """Make ``path`` (a folder in one of the service's) the job user's, mode 0700."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchown(fd, uid, uid)
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def claim_dir(path: str, uid: int, protected: Sequence[Path], *, field: str) -> None:
    """Make folder ``path`` the job user's (``uid``), as the module's docstring says of checkpoint folders.

    Walks the path from ``/`` one folder at a time without following a link (a folder swapped for a
    link meanwhile is refused), making what is missing: the folders above, root's and searchable (0755),
    the last one the job user's (0700). A folder that exists is never given away.

    Raises:
        CouldNotStart: the folder is refused; the message names ``field``, the path and why.
    """
    if not os.path.isabs(path):
        raise CouldNotStart(f"{field} must be an absolute path (a sandboxed task's working directory is its "
                            f"own, new for every attempt), but got {path!r}")
    resolved = Path(os.path.realpath(path))
    for platform in protected:
        if resolved == platform or platform in resolved.parents:
            raise CouldNotStart(f"{field} {path!r} is in {str(platform)!r}, a folder of the platform's or the "
                                "system's: a job's folder is never made there")
    names = resolved.parts[1:]
    if not names:
        raise CouldNotStart(f"{field} cannot be '/'")
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    try:
        for depth, name in enumerate(names):
            above = os.fstat(fd)
            if not _searchable(above, uid):
                where = "/" + "/".join(names[:depth])
                raise CouldNotStart(f"{field} {path!r} cannot be reached by the job's user (uid {uid}): "
                                    f"{where!r} is mode {stat.S_IMODE(above.st_mode):04o} of uid {above.st_uid}")
            last = depth == len(names) - 1
            made = True
            try:
                os.mkdir(name, 0o700 if last else 0o755, dir_fd=fd)
            except FileExistsError:
                made = False
            try:
                child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                raise CouldNotStart(f"{field} {path!r}: {'/' + '/'.join(names[:depth + 1])!r} is not a folder "
                                    f"({exc.strerror})") from None
            os.close(fd)
            fd = child
            if made:
                if last:
                    os.fchown(fd, uid, uid)
                    os.fchmod(fd, 0o700)
                else:
                    os.fchmod(fd, 0o755)
            elif last and (owner := os.fstat(fd).st_uid) != uid:
                raise CouldNotStart(f"{field} {path!r} exists and belongs to uid {owner}, not to the job's user "
                                    f"(uid {uid}): give a folder that does not exist yet (it is made for the job), "
                                    f"or one made for this job before")
    finally:
        os.close(fd)


def _searchable(folder: os.stat_result, uid: int) -> bool:
    """Whether a process of ``uid`` (gid the same, no other group) may search ``folder``."""
    if folder.st_uid == uid:
        return bool(folder.st_mode & stat.S_IXUSR)
    if folder.st_gid == uid:
        return bool(folder.st_mode & stat.S_IXGRP)
    return bool(folder.st_mode & stat.S_IXOTH)


def _read_status(fd: int) -> str:
    """What the helper wrote to its status pipe before it closed (nothing: the command runs)."""
    chunks = []
    size = 0
    while chunk := os.read(fd, 4096):
        if size < _MAX_STATUS_BYTES:
            chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)[:_MAX_STATUS_BYTES].decode(errors="replace")


def _probe(probe: RunSandbox) -> str | None:
    """Run this Python, doing nothing, in ``probe`` (its folder made, then removed): None if it ran, else
    why it could not (for people)."""
    try:
        MOUNT_POINT.mkdir(mode=0o755, exist_ok=True)
        if MOUNT_POINT.is_symlink() or not MOUNT_POINT.is_dir():
            return f"{MOUNT_POINT} is not a folder"
    except OSError as exc:
        return f"the mount point {MOUNT_POINT} cannot be made: {exc.strerror}"
    shutil.rmtree(probe.root, ignore_errors=True)
    _own_dir(probe.root, probe.uid)
    read_fd, write_fd = os.pipe()
    try:
        try:
            helper = subprocess.Popen(HELPER_COMMAND, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, env={}, pass_fds=(write_fd,))
        finally:
            os.close(write_fd)
        config = probe._config([sys.executable, "-I", "-S", "-c", ""], {}, cwd=str(MOUNT_POINT), status_fd=write_fd)
        output, _ = helper.communicate(config, timeout=60)
        reason = _read_status(read_fd)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"the sandbox's probe could not run: {exc}"
    finally:
        os.close(read_fd)
        shutil.rmtree(probe.root, ignore_errors=True)
    if reason or helper.returncode != 0:
        said = output.decode(errors="replace").strip()
        return f"the sandbox's probe failed ({reason or f'exit code {helper.returncode}'}{': ' + said if said else ''})"
    return None
