"""Keep freed frame-stack chunks for reuse, so a loop at a chunk's edge stops mapping one per call.

CPython 3.11 keeps a thread's frames in 16 KiB chunks mapped from the OS and unmaps a chunk as soon
as the frame at its start returns. A training loop whose per-step call lands at that edge maps,
faults and unmaps a chunk on every step: +400k minor faults and +7% CPU on the bench's 48 s job at
one stack depth (docs/benchmarks.md, "Where the job thread's extra goes"). Where the edge falls
depends on how deep the loop runs, so any frame added beneath it, the tracer's included, moves the
churn onto or off a job's loop: the tracer's whole-process cost was mostly this lottery. CPython
fixed it in 3.13 and 3.14 by caching one chunk per thread (python/cpython#142183); this does the
same for the versions the platform runs, in traced processes (from their start: sitecustomize).
"""

from __future__ import annotations

import sys

# 3.13 and later keep a chunk themselves, and newer interpreters take other buffers from the same
# allocator (3.14's JIT), which must not get a used block; below 3.13 the only 16 KiB blocks taken
# from it are frame-stack chunks (object arenas are 256 KiB or 1 MiB).
NEEDED = sys.version_info < (3, 13)


def keep_spare_chunks() -> None:
    """Install the chunk-keeping arena allocator in this process (once; later calls, and Pythons
    that keep chunks themselves, do nothing)."""
    if not NEEDED:
        return
    from opml_trace_collector.inject import _spare_chunks

    _spare_chunks.install()


def chunk_reuses() -> int:
    """Chunk allocations a kept chunk has served in this process (0 where none were kept)."""
    module = sys.modules.get("opml_trace_collector.inject._spare_chunks")
    return module.reuses() if module else 0
