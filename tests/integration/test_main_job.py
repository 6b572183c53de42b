"""The platform's main job (what `make up` runs) against services started as `make up` starts them."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)
def test_main_job_succeeds_against_every_installed_service(start_service, stack_specs, settings_env: dict[str, str],
                                                          unique_prefix: str, tmp_path: Path) -> None:
    env = {"OPML_MAIN_JOB_REMOTE": f"s3://{unique_prefix.rstrip('-')}/vision-inspection"}
    for spec in stack_specs:  # auth off, as `make up` runs them; each knows where the earlier ones are
        process = start_service(spec, tokens=None, extra_env=env)
        env.update(spec.targets(process.env))
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "main_job.py"), "--scale", "quick",
                             "--out", str(tmp_path / "main-job")],
                            env={**os.environ, **settings_env, **env}, capture_output=True, text=True, timeout=720)
    print(result.stdout)  # the story as it went, with the summary table (shown with -s)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "content hash equal in both contexts" in result.stdout
    assert "opml.bundles.v1.BundlePushed" in result.stdout
    assert "steps, patched" in result.stdout  # the best trial's traced run reached the trace-collector
    assert "MaxTrialsReached" in result.stdout and "best model committed" in result.stdout  # the tuning step
    assert "TRIAL_STATE_SUCCEEDED val_accuracy=" in result.stdout  # the Trace collector read the trials' epochs
    assert "blessed=True" in result.stdout and "inspection version 1 SERVING 100%" in result.stdout  # the pipeline
    # the loop: line 3's drift raises an alert, the alert runs the pipeline, its rollout promotes the new model
    [alert] = [line for line in result.stdout.splitlines() if "event opml.monitoring.v1.AlertRaised" in line]
    assert "inspection version 1 line 3:" in alert, alert  # line 3's own alert, judged against its own rows
    assert "lines 1, 2, 4: no alert on their clean traffic" in result.stdout
    assert "of pipeline inspection, triggered by: alert: inspection version 1" in result.stdout
    assert "event opml.inference.v1.RolloutPromoted version 2" in result.stdout
    assert "version 2 promoted" in result.stdout
    assert "summary" in result.stdout and (tmp_path / "main-job" / "steps.png").stat().st_size
    assert (tmp_path / "main-job" / "accuracy.png").stat().st_size and (tmp_path / "main-job" / "rollout.png").stat().st_size
    assert (tmp_path / "main-job" / "trials.png").stat().st_size
    # the federated step: TiFL tiers after the profiling round, the model shipped and served, compared per line
    assert "round 2: tier " in result.stdout and "inspection-federated version 1 SERVING 100%" in result.stdout
    assert (tmp_path / "main-job" / "federated.png").stat().st_size
