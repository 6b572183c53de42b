"""`make up` over an earlier run's state (issue 12, item 7): the same Redis keys, S3 data, broker log
and service homes, after a crash.

The whole supervised stack runs twice as `make up` runs it (``python -m opml_devstack.stack up
--main-job scripts/main_job.py``) over one state directory, Redis prefix, topic prefix and homes. The
first run is crashed after its main job (SIGKILL of the stack and of the router: no shutdown of
either); the router's Redis also holds a version of another model whose bundle is gone (what an
earlier run may leave); the second run starts over all that. The main job must pass both times, the
second one waiting for the version it deployed, not for one the router restored; the router must
have brought back what served before the crash and say precisely why the other cannot come back.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from opml_devstack.testing.bus import poll_until

pytestmark = pytest.mark.timeout(1800)

ROOT = Path(__file__).resolve().parents[2]
RESTORED = re.compile(r"restored deployments: (\{.*\})")


def _up(root: Path, prefix: str, log_path: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "opml_devstack.stack", "up", "--main-job", str(ROOT / "scripts" / "main_job.py"),
               "--state-dir", str(root / "state"), "--free-ports", "--no-prometheus", "--topic-prefix", prefix,
               "--redis-prefix", f"opml-test:{prefix}", "--homes", str(root / "homes"), "--backoff-base", "0.2",
               "--backoff-max", "2"]
    env = {key: value for key, value in os.environ.items() if not key.startswith("OPML_")}
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True, cwd=ROOT)


def _main_job_ended(process: subprocess.Popen, log_path: Path) -> str | None:
    text = log_path.read_text(errors="replace")
    if process.poll() is not None:
        raise AssertionError(f"the stack exited with {process.returncode}:\n{text[-6000:]}")
    found = re.search(r"main job (succeeded|FAILED \(\d+\))", text)
    return found.group(1) if found else None


async def _store_a_version_whose_bundle_is_gone(prefix: str) -> str:
    """What an earlier run may leave: a SERVING version of a model whose bundle no longer exists."""
    from opml_common.config import PlatformSettings
    from opml_common.storage import redis_client
    from opml_inference_router.control import DeploymentStore, Source
    from opml_inference_router.control.state import SERVING, ModelRecord, VersionRecord

    gone = str(uuid.uuid4())
    settings = PlatformSettings(redis_prefix=f"opml-test:{prefix}")
    redis = redis_client(settings)
    try:
        record = ModelRecord("ghost", {3: VersionRecord(3, Source(context="plant-a", bundle=gone), "/gone",
                                                        state=SERVING, bundle_uuid=gone)}, stable=3,
                             traffic={"3": 1.0})
        await DeploymentStore(redis, prefix=settings.redis_prefix).save_model(record)
    finally:
        await redis.aclose()
    return gone


def _parts(root: Path) -> dict[str, dict]:
    return {part["name"]: part for part in json.loads((root / "state" / "stack.json").read_text())["parts"]}


def test_make_up_twice_over_the_same_state_with_a_crash_between(tmp_path: Path) -> None:
    prefix = f"t{uuid.uuid4().hex[:10]}-"
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    router_log = tmp_path / "state" / "logs" / "inference-router.log"

    first = _up(tmp_path, prefix, first_log)
    try:
        outcome = poll_until(lambda: _main_job_ended(first, first_log), timeout_s=800, what="the first main job")
        assert outcome == "succeeded", first_log.read_text(errors="replace")[-8000:]
        router = _parts(tmp_path)["inference-router"]["pid"]
        os.kill(first.pid, signal.SIGKILL)  # the stack dies first: nothing restarts the router or stops the rest
        first.wait()
        os.killpg(router, signal.SIGKILL)  # the router and its workers (its process group), mid-serving
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()

    ghost = asyncio.run(_store_a_version_whose_bundle_is_gone(prefix))
    second = _up(tmp_path, prefix, second_log)  # stops what the first stack left running, then starts over it
    try:
        outcome = poll_until(lambda: _main_job_ended(second, second_log), timeout_s=800, what="the second main job")
        text = second_log.read_text(errors="replace")
        assert outcome == "succeeded", text[-8000:]
        assert "stopped what an earlier stack left running" in text
        router_text = router_log.read_text(errors="replace")
        restored = RESTORED.findall(router_text)
        assert restored and restored[-1] == ("{'ghost': ['3 FAILED'], 'inspection': ['2 SERVING'], "
                                             "'inspection-federated': ['1 SERVING']}"
                                             ), restored  # inspection: the loop's promoted push; -federated: step 7's
        assert (f"models/ghost/versions/3 not restored after a restart: bundle {ghost!r} does not exist in "
                f"context 'plant-a'") in router_text
        # The second main job found the first one's promoted version serving, and its loop deployed its own
        # version 3 and followed that one to its promotion, not failing on the stored version that could not
        # come back.
        assert re.search(r"inspection version 2 SERVING 100%", text), text[-8000:]
        assert "version 3 promoted" in text, text[-8000:]
    finally:
        pids = [part["pid"] for part in _parts(tmp_path).values() if part.get("pid")]
        second.send_signal(signal.SIGTERM)  # as `make down` does
        try:
            second.wait(timeout=180)
        except subprocess.TimeoutExpired:
            second.kill()
            second.wait()
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    assert second.returncode == 0, second_log.read_text(errors="replace")[-6000:]
