"""What a job run by the job orchestrator reads from its environment, and how it answers back.

Shared by the example programs beside it. The orchestrator sets, for every task:
``TF_CONFIG`` (the cluster and this task), ``OPML_JOB_ID``, ``OPML_JOB_ATTEMPT`` (0, then one more
for every retry or resume), ``OPML_TASK_TYPE``, ``OPML_TASK_INDEX``, ``OPML_CHECKPOINT_DIR`` (where
to save and where a resumed run finds its checkpoint) and ``OPML_HEARTBEAT_FILE`` (touch it to say
"alive"; write ``{"checkpoint_step": N}`` to it to report a checkpoint, which tells the scheduler
that stopping the job now loses little). A preemption is a SIGTERM: save, then exit.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path


def tf_config() -> dict:
    return json.loads(os.environ["TF_CONFIG"])


def attempt() -> int:
    return int(os.environ.get("OPML_JOB_ATTEMPT", "0"))


def checkpoint_dir() -> Path:
    return Path(os.environ["OPML_CHECKPOINT_DIR"])


def report_checkpoint(step: int) -> None:
    """Tell the orchestrator a checkpoint of ``step`` is saved (written whole: a rename is atomic)."""
    beat = os.environ.get("OPML_HEARTBEAT_FILE")
    if beat:
        partial = Path(beat + ".partial")
        partial.write_text(json.dumps({"checkpoint_step": step}))
        os.replace(partial, beat)


class Preemption:
    """Notes a SIGTERM, so the training loop saves and exits at the end of the current step
    (TensorFlow must not be called from inside a signal handler)."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._note)

    def _note(self, *_: object) -> None:
        self.requested = True
