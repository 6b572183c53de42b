"""The platform's main job (what `make up` runs) against services started as `make up` starts them."""

import os
import subprocess
import sys
from pathlib import Path

from opml_common.devinfra import free_port
from opml_common.process import ServiceProcess
from opml_common.stack import installed_services

ROOT = Path(__file__).resolve().parents[2]


def test_main_job_succeeds_against_every_installed_service(settings_env: dict[str, str], unique_prefix: str,
                                                          tmp_path: Path) -> None:
    env = {**settings_env, "OPML_MAIN_JOB_REMOTE": f"s3://{unique_prefix.rstrip('-')}/vision-inspection"}
    processes = []
    try:
        for spec in installed_services():
            port = free_port()
            prefix = spec.settings.model_config["env_prefix"]
            env.update({f"{prefix}GRPC_PORT": str(port), f"{prefix}METRICS_PORT": str(free_port()),
                        f"{prefix}HOME": str(tmp_path / spec.name)})
            env[f"{prefix}TARGET"] = f"127.0.0.1:{port}"
            processes.append(ServiceProcess(spec.module, port, dict(env), tmp_path / f"{spec.name}.log").start())
        result = subprocess.run([sys.executable, str(ROOT / "scripts" / "main_job.py")], env={**os.environ, **env},
                                capture_output=True, text=True, timeout=300)
    finally:
        for process in processes:
            process.stop()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "content hash equal in both contexts" in result.stdout
    assert "opml.bundles.v1.BundlePushed" in result.stdout
    assert "JOB_STATE_SUCCEEDED" in result.stdout and "test accuracy" in result.stdout
    assert "steps, patched" in result.stdout  # the traced run reached the trace-collector
    assert "SERVING 100%" in result.stdout and "opml.inference.v1.PredictionMade" in result.stdout
