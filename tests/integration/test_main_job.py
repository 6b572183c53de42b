"""The platform's main job (what `make up` runs) against services started as `make up` starts them."""

import os
import subprocess
import sys
from pathlib import Path

from opml_devstack.stack import installed_services

ROOT = Path(__file__).resolve().parents[2]


def test_main_job_succeeds_against_every_installed_service(start_service, settings_env: dict[str, str],
                                                          unique_prefix: str) -> None:
    env = {"OPML_MAIN_JOB_REMOTE": f"s3://{unique_prefix.rstrip('-')}/vision-inspection"}
    for spec in installed_services():  # auth off, as `make up` runs them; each knows where the earlier ones are
        process = start_service(spec, tokens=None, extra_env=env)
        env.update(spec.targets(process.env))
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "main_job.py")],
                            env={**os.environ, **settings_env, **env}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "content hash equal in both contexts" in result.stdout
    assert "opml.bundles.v1.BundlePushed" in result.stdout
    assert "JOB_STATE_SUCCEEDED" in result.stdout and "test accuracy" in result.stdout
    assert "steps, patched" in result.stdout  # the traced run reached the trace-collector
    assert "SERVING 100%" in result.stdout and "opml.inference.v1.PredictionMade" in result.stdout
