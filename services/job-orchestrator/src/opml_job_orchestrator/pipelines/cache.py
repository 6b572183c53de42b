"""Cache keys of steps: by content, never by identity.

A step's key is the sha256 of its kind, its own spec (canonical JSON), its code's version, and the
content hashes of the bundles it reads, in order (the bundle-store's ``content_hash``: sha256 over
every file's path and sha256, and the values). Two runs whose step has equal keys would compute
the same outputs, so the later one reuses the earlier one's (TFX keys its cache on artifact ids:
a byte-identical span re-ingested misses, and a changed file behind the same id hits; here the
first is a hit and the second a miss).

The platform's step programs' version is a hash of their source files, so changing the code of
validate or evaluate invalidates their cache; a train step's is the user's ``code_version``
(a git commit) with its command and settings.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

from google.protobuf.json_format import MessageToDict
from opml.jobs.v1 import pipelines_pb2 as pb

_STEP_PROGRAM_MODULES = ("stepjobs.py", "table.py", "statistics.py", "schema.py", "anomalies.py", "evaluation.py")


@functools.cache
def platform_code_version() -> str:
    """sha256 of the step program's modules (validate, evaluate), as they are installed."""
    digest = hashlib.sha256()
    here = Path(__file__).parent
    for name in _STEP_PROGRAM_MODULES:
        path = here / name
        digest.update(name.encode() + b"\0")
        digest.update(path.read_bytes() if path.is_file() else b"<absent>")
    return digest.hexdigest()


def code_version(step: pb.PipelineStep) -> str:
    """What version of code a step runs: the user's ``code_version`` for train, the platform's otherwise."""
    if step.kind == pb.STEP_KIND_TRAIN:
        return f"user:{step.train.code_version}"
    return f"platform:{platform_code_version()}"


def cache_key(step: pb.PipelineStep, inputs: Sequence[tuple[str, str]]) -> str:
    """The key of ``step`` reading ``inputs``: (role, content hash) pairs in the order the step reads them."""
    document = {"kind": int(step.kind), "spec": MessageToDict(step, preserving_proto_field_name=True),
                "code": code_version(step), "inputs": [list(pair) for pair in inputs]}
    document["spec"].pop("name", None)  # renaming a step changes nothing it computes
    document["spec"].pop("inputs", None)  # what it reads is in `inputs`, by content
    return hashlib.sha256(json.dumps(document, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
