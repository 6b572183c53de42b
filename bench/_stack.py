"""The real services a bench runs against: embedded infrastructure (DevInfra: tansu, SeaweedFS, the
machine's Redis) and a ServiceStarter under a unique topic and Redis prefix, every process stopped
and every key under the prefix deleted at the end; and the automl-controller with the job-orchestrator
it submits trials to."""

from __future__ import annotations

import json
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from opml_devstack.devinfra import DevInfra
from opml_devstack.stack import delete_redis_keys
from opml_devstack.testing.services import TOKENS, ServiceStarter


@contextmanager
def deleting_redis_keys(redis_url: str, prefix: str) -> Iterator[str]:
    """Yields ``prefix``; at the end, an error's too, deletes every key under it (SCAN and UNLINK): the
    machine's Redis outlives the bench and is shared with tests and `make up`."""
    try:
        yield prefix
    finally:
        delete_redis_keys(redis_url, prefix)


@contextmanager
def bench_services() -> Iterator[tuple[ServiceStarter, Path]]:
    """(a starter of service processes, a scratch directory), both gone at the end."""
    with tempfile.TemporaryDirectory() as workdir, DevInfra(workdir=Path(workdir) / "infra") as endpoints:
        prefix = f"b{uuid.uuid4().hex[:8]}-"
        with deleting_redis_keys(endpoints.redis_url, f"opml-bench:{prefix}") as redis_prefix:
            starter = ServiceStarter({**endpoints.env(), "OPML_TOPIC_PREFIX": prefix,
                                      "OPML_REDIS_PREFIX": redis_prefix, "OPML_LOG_FORMAT": "text"}, Path(workdir))
            try:
                yield starter, Path(workdir)
            finally:
                starter.stop_all()


def automl_controller(starter: ServiceStarter, **orchestrator_env: str) -> str:
    """Starts a job-orchestrator (one 8-CPU node, fast log polling, ``orchestrator_env`` on top) and an
    automl-controller submitting to it; returns the controller's target (auth on: TOKENS)."""
    orchestrator = starter("job-orchestrator", extra_env={
        "OPML_JOB_ORCHESTRATOR_NODES": json.dumps([{"name": "n0", "cpu_millis": 8000, "memory_mib": 8192}]),
        "OPML_JOB_ORCHESTRATOR_LOG_POLL_S": "0.05", **orchestrator_env})
    return starter("automl-controller", extra_env={
        "OPML_AUTOML_CONTROLLER_JOB_ORCHESTRATOR_TARGET": orchestrator.target,
        "OPML_AUTOML_CONTROLLER_JOB_ORCHESTRATOR_TOKEN": TOKENS["writer"]}).target
