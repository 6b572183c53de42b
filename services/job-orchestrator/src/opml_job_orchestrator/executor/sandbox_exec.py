"""Turns the process it runs in into a sandboxed task, then runs the task's command in it.

The local executor starts it as root, as ``python -I -S sandbox_exec.py`` (the standard library only:
no site-packages, no ``PYTHON*`` variable, nothing from the job's environment), and writes what to run
to its stdin as one JSON document. In this one process, which becomes the task (same pid, same process
group, so the executor's signals and the exit code are the task's own):

1. a mount namespace of its own, its mounts private (nothing it mounts is seen outside);
2. ``/proc`` mounted anew with ``hidepid=invisible``: only the processes of the task's own user are
   listed, so the services' ``/proc/<pid>/environ`` is not even there (a PID namespace would hide them
   too, but it makes the task PID 1, which ignores a SIGTERM it has no handler for and cannot die of a
   signal, so the executor's grace and the exit codes would change);
3. the run's sandbox folder bound at ``mount_point``: the task reaches its working directory, its
   heartbeat file and its trace spool there, whatever the modes of the folders above the run's (the
   orchestrator's home is 0700);
4. each ``expose`` folder (the Python the platform runs on, when it lives in a folder the task's
   user cannot enter, such as pyenv's under ``/root``) bound read-only at its own path, alone in an
   empty tmpfs laid over the folder that hid it (so nothing else of that folder shows);
5. no supplementary groups, the job's gid and uid (real, effective and saved), ``no_new_privs`` (no
   setuid program gives anything back), umask 077, the working directory;
6. the command, looked up on the job's own ``PATH``, with the job's environment.

Nothing runs as root with the job's environment, so no variable of the job (``GCONV_PATH``,
``LOCPATH``, ``GLIBC_TUNABLES``...) can steer a step that runs as root. Whatever fails before the
command runs (a mount, the command not found) is written to ``status_fd``, which the executor reads
until it closes: closed with nothing written means the command runs.
"""

import ctypes
import json
import os
import sys

CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x2, 0x4, 0x8
MS_RDONLY, MS_REMOUNT = 0x1, 0x20
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000
PR_SET_NO_NEW_PRIVS = 38

_libc = ctypes.CDLL(None, use_errno=True)


def _call(what: str, result: int) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None, what: str) -> None:
    def arg(text: str | None) -> bytes | None:
        return None if text is None else os.fsencode(text)

    _call(what, _libc.mount(arg(source), arg(target), arg(fstype), ctypes.c_ulong(flags), arg(data)))


def enter(config: dict) -> None:
    """Steps 1 to 5 of the module's docstring, for ``config``'s uid, gid, sandbox, mount point and ``expose``."""
    uid, gid = int(config["uid"]), int(config["gid"])
    if uid <= 0 or gid <= 0:
        raise ValueError(f"a sandboxed task never runs as root, but got uid {uid} gid {gid}")
    _call("unshare the mount namespace", _libc.unshare(CLONE_NEWNS))
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None, "make the mounts private")
    _mount(config["sandbox"], config["mount_point"], None, MS_BIND | MS_REC, None,
           f"bind the run's sandbox on {config['mount_point']}")
    exposed = [(os.open(path, os.O_PATH | os.O_DIRECTORY), path) for path, _ in config["expose"]]
    for under in dict.fromkeys(under for _, under in config["expose"]):
        _mount("tmpfs", under, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k", f"lay a tmpfs over {under}")
    for fd, path in exposed:
        os.makedirs(path, 0o755, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC, None, f"bind {path}")
        _mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY, None, f"make {path} read-only")
        os.close(fd)
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=invisible",
           "mount /proc with hidepid=invisible")
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    _call("set no_new_privs", _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid) or os.getgroups():
        raise PermissionError(f"the privileges were not dropped: uids {os.getresuid()}, gids {os.getresgid()}")
    os.umask(0o077)
    os.chdir(config["cwd"])


def main() -> int:
    config = json.loads(sys.stdin.buffer.read())
    status = int(config["status_fd"])
    os.set_inheritable(status, False)  # closed by a successful exec: the executor's sign that the command runs
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    argv = [str(a) for a in config["argv"]]
    try:
        enter(config)
    except (OSError, ValueError) as exc:
        os.write(status, f"sandbox: {exc}".encode())
        return 126
    try:
        os.execvpe(argv[0], argv, {str(k): str(v) for k, v in config["env"].items()})
    except OSError as exc:
        os.write(status, f"{exc.strerror}: {argv[0]!r}".encode())
        return 127 if isinstance(exc, FileNotFoundError) else 126
    except ValueError as exc:  # a NUL byte in argv or env (a job saved before the rule)
        os.write(status, str(exc).encode())
        return 126
    return 126  # not reached: execvpe returns only by raising


if __name__ == "__main__":
    sys.exit(main())
