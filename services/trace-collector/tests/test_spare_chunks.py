"""A traced process keeps freed frame-stack chunks from its start: a loop at a chunk's edge, which
maps a chunk per call in an untraced CPython 3.11 process, maps none in the tracer's environment.

Counted in minor faults (each fresh chunk faults its first page) and in the reuses the kept
chunks served, both exact counts, on the same program run both ways."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from opml_trace_collector.inject.launcher import build_env

PROGRAM = Path(__file__).parent / "programs" / "chunk_edge.py"
CALLS = 20_000


def _run(env: dict[str, str]) -> dict:
    result = subprocess.run([sys.executable, str(PROGRAM), str(CALLS)], env=env, capture_output=True,
                            text=True, timeout=120, check=True)
    return json.loads(result.stdout)


def test_a_loop_at_a_chunk_edge_maps_a_chunk_per_call_untraced_and_none_traced() -> None:
    untraced = _run(dict(os.environ))
    traced = _run(build_env("chunk-edge", "w0", dict(os.environ)))

    assert untraced["reuses"] == 0
    assert untraced["worst_depth_faults"] >= CALLS, "the sweep crosses a chunk's edge: one chunk mapped a call"
    assert traced["reuses"] >= CALLS, "the same calls are served by a kept chunk"
    assert traced["worst_depth_faults"] < CALLS // 100
    assert untraced["faults"] - traced["faults"] >= CALLS * 0.9
