"""`make clean` (``stack clean``) is a full reset of what `make up` made: the stack stopped, its Redis
keys, its services' homes and its state directory gone, and nothing of anyone else's touched.

A real Redis (the machine's, 127.0.0.1:6379, shared with other tests and stacks: each test's keys
under a prefix of its own) and a real process standing for the running stack.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import uuid
from pathlib import Path

import pytest
import redis

from opml_devstack.stack import StackConfig, clean, delete_redis_keys, loadable_services

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
def db() -> redis.Redis:
    client = redis.Redis.from_url(REDIS_URL)
    yield client
    client.close()


def test_clean_stops_the_stack_and_removes_its_keys_homes_and_state(db: redis.Redis, tmp_path: Path) -> None:
    prefix = f"opml-test:clean-{uuid.uuid4().hex[:8]}:"
    neighbour = prefix.rstrip(":") + "x:"  # another stack's prefix that shares this one's beginning
    config = StackConfig(state_dir=tmp_path / "state", redis_prefix=prefix, homes=tmp_path / "homes")
    # the stack is not clean's child (no zombie of it lingers): a process its shell left behind
    stack = int(subprocess.run(["sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $!"], check=True, capture_output=True,
                               text=True).stdout)
    try:
        config.state_dir.mkdir()
        config.pid_file.write_text(str(stack))
        config.state_file.write_text(json.dumps({"pid": stack, "endpoints": {"redis": REDIS_URL}, "parts": []}))
        (config.homes / "bundle-store" / "outbox").mkdir(parents=True)
        (config.homes / "job-orchestrator").mkdir(parents=True)
        ours = [f"{prefix}inference-router:deployments", f"{prefix}bus:dedup:g:1", f"{prefix}traces:capture:j"]
        for key in ours:
            db.set(key, b"1")
        db.set(f"{neighbour}kept", b"1")
        try:
            assert clean(config) == 0

            assert not _running(stack)
            assert db.exists(*ours) == 0
            assert db.get(f"{neighbour}kept") == b"1"
            assert not config.state_dir.exists()
            assert not (config.homes / "bundle-store").exists() and not (config.homes / "job-orchestrator").exists()
        finally:
            db.delete(*ours, f"{neighbour}kept")
    finally:
        if _running(stack):
            os.kill(stack, signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        return not Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].startswith("Z")
    except OSError:
        return False


def test_without_homes_given_each_services_own_home_is_removed(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """`make up` gives no --homes: each service runs in the home its settings name (~/.opml/<service>
    unless its ``<PREFIX>HOME`` says otherwise; here every one does, so this machine's are not touched)."""
    homes = {spec.env_prefix: tmp_path / spec.name for spec in loadable_services()[0]
             if "home" in spec.settings.model_fields}
    assert homes
    for prefix, home in homes.items():
        (home / "outbox").mkdir(parents=True)
        monkeypatch.setenv(f"{prefix}HOME", str(home))
    config = StackConfig(state_dir=tmp_path / "state", redis_prefix=f"opml-test:clean-{uuid.uuid4().hex[:8]}:")

    assert clean(config) == 0

    assert [home for home in homes.values() if home.exists()] == []


def test_glob_characters_in_a_prefix_match_only_themselves(db: redis.Redis) -> None:
    base = f"opml-test:clean-{uuid.uuid4().hex[:8]}"
    prefix, other = f"{base}[*]?:", f"{base}*x:"
    db.set(f"{prefix}a", b"1")
    db.set(f"{other}b", b"1")
    try:
        assert delete_redis_keys(REDIS_URL, prefix) == 1
        assert db.exists(f"{prefix}a") == 0 and db.get(f"{other}b") == b"1"
    finally:
        db.delete(f"{prefix}a", f"{other}b")


def test_an_empty_prefix_is_refused() -> None:
    with pytest.raises(ValueError, match="every key"):
        delete_redis_keys(REDIS_URL, "")
