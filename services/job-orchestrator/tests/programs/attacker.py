"""A job that tries, as an attacker would, to read what is not its own and to write the platform's files.

``argv[1]`` is a JSON object of targets: ``environ_pids`` (processes whose ``/proc/<pid>/environ`` it
reads, beside every process it can list in ``/proc``), ``read`` (files), ``list`` (folders), ``write``
(folders it tries to create a file in), each by a name. It prints one JSON line: its uid, the uids of
the processes it could list, what it ``managed`` (by name) and why the rest was ``refused``.
"""

import json
import os
import sys


def attempt(managed: dict, refused: dict, name: str, action) -> None:
    try:
        managed[name] = action()
    except OSError as exc:
        refused[name] = f"{type(exc).__name__}: {exc.strerror}"


def read(path: str) -> str:
    with open(path, "rb") as file:
        return f"read {len(file.read())} bytes"


def write(folder: str) -> str:
    path = os.path.join(folder, f"planted-by-{os.getuid()}")
    with open(path, "x") as file:
        file.write("planted")
    os.remove(path)
    return f"created {path}"


def main() -> None:
    targets = json.loads(sys.argv[1])
    uid = os.getuid()
    managed: dict[str, str] = {}
    refused: dict[str, str] = {}
    listed = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    listed_uids = set()
    for pid in listed:
        try:
            owner = os.stat(f"/proc/{pid}").st_uid
        except OSError:
            continue  # it ended meanwhile
        listed_uids.add(owner)
        if owner != uid:
            attempt(managed, refused, f"environ of listed pid {pid} (uid {owner})", lambda p=pid: read(f"/proc/{p}/environ"))
    for name, pid in targets["environ_pids"].items():
        attempt(managed, refused, f"environ of {name}", lambda p=pid: read(f"/proc/{p}/environ"))
        attempt(managed, refused, f"cwd of {name}", lambda p=pid: str(os.listdir(f"/proc/{p}/cwd")))
    for name, path in targets["read"].items():
        attempt(managed, refused, f"read {name}", lambda p=path: read(p))
    for name, path in targets["list"].items():
        attempt(managed, refused, f"list {name}", lambda p=path: str(os.listdir(p)))
    for name, path in targets["write"].items():
        attempt(managed, refused, f"write {name}", lambda p=path: write(p))
    print(json.dumps({"uid": uid, "listed_uids": sorted(listed_uids), "managed": managed, "refused": refused}))


if __name__ == "__main__":
    main()
