"""Calls a function in a loop at every stack depth over more than one frame-stack chunk, and prints
(JSON) the minor faults of the whole sweep and of its worst depth, and the chunk reuses the tracer's
kept chunks served. At the depth where the loop's callee starts a chunk, CPython 3.11 maps and
unmaps a chunk per call (one fault each) unless freed chunks are kept.

Usage: chunk_edge.py CALLS"""

import json
import resource
import sys


def leaf() -> int:
    return 1


def loop(calls: int) -> None:
    for _ in range(calls):
        leaf()


def at_depth(depth: int, calls: int) -> None:
    if depth == 0:
        loop(calls)
        return
    at_depth(depth - 1, calls)


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    calls = int(sys.argv[1])
    began, worst = faults(), 0
    for depth in range(400):  # at_depth's frames are >= 80 bytes: 400 of them span more than 16 KiB
        before = faults()
        at_depth(depth, calls)
        worst = max(worst, faults() - before)
    swept = faults() - began
    from opml_trace_collector.inject.spare_chunks import chunk_reuses  # after the count: no import in it
    print(json.dumps({"faults": swept, "worst_depth_faults": worst, "reuses": chunk_reuses()}))


if __name__ == "__main__":
    main()
