"""``python -m opml_trace_collector.inject.run --job JOB [--worker W] -- cmd args...``"""

from __future__ import annotations

import argparse
import sys

from opml_trace_collector.inject.launcher import run_traced


def main(args: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opml_trace_collector.inject.run",
                                     description="Run a command with its TensorFlow traced (no change to its code).")
    parser.add_argument("--job", required=True, help="job name the events are filed under")
    parser.add_argument("--worker", default=None, help="worker name (default: from TF_CONFIG's task, else 'local')")
    parser.add_argument("--no-shipper", action="store_true",
                        help="do not start the host's shipper (the events wait in the spool for one)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command and its arguments")
    ns = parser.parse_args(args)
    command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if not command:
        parser.error("give the command to run after --")
    return run_traced(command, job=ns.job, worker=ns.worker, shipper=not ns.no_shipper)


if __name__ == "__main__":
    sys.exit(main())
