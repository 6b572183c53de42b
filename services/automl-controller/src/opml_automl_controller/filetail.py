"""``python -m opml_automl_controller.filetail PATH -- ARGV...``: the File collector's wrapper.

Katib injects a sidecar that reads the metrics file; here the trial's command runs as a child of
this small program, which copies each line appended to PATH onto its own stdout with
:data:`~opml_automl_controller.collect.FILE_MARKER`, so the controller reads them from the job's
log stream with the rest. It exits with the child's status, after the file's last lines.
SIGTERM (a cancelled or pruned trial) is passed on to the child.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from opml_automl_controller.collect import FILE_MARKER, MAX_LINE_CHARS


def _copy(path: str, offset: int, partial: str, *, final: bool) -> tuple[int, str]:
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            data = handle.read()
    except FileNotFoundError:
        return offset, partial
    offset += len(data)
    lines = (partial + data.decode("utf-8", "replace")).split("\n")
    partial = lines.pop()
    if final and partial:
        lines.append(partial)
        partial = ""
    for line in lines:
        sys.stdout.write(FILE_MARKER + line[:MAX_LINE_CHARS] + "\n")
    sys.stdout.flush()
    return offset, partial[-MAX_LINE_CHARS:]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[1] != "--":
        sys.stderr.write("usage: python -m opml_automl_controller.filetail PATH -- ARGV...\n")
        return 2
    path, command = args[0], args[2:]
    offset = os.path.getsize(path) if os.path.exists(path) else 0  # lines of an earlier run are not this one's
    child = subprocess.Popen(command)
    signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM))
    partial = ""
    while child.poll() is None:
        offset, partial = _copy(path, offset, partial, final=False)
        time.sleep(0.1)
    _copy(path, offset, partial, final=True)
    return child.returncode if child.returncode >= 0 else 128 - child.returncode


if __name__ == "__main__":
    sys.exit(main())
