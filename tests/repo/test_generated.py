"""Generated files are never stale: the protobuf stubs and the configuration reference."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_protobuf_stubs_match_protos() -> None:
    result = _run("scripts/gen_protos.py", "protos", "protos/python", "--check")
    assert result.returncode == 0, result.stdout + result.stderr


def test_configuration_reference_matches_settings() -> None:
    result = _run("scripts/gen_config_doc.py", "--check")
    assert result.returncode == 0, result.stdout + result.stderr
