"""The router SIGKILLed in the middle of a deploy (issue 12, items 6 and 7), on real processes and Redis.

The deploy is held mid-way deterministically: the router's worker is SIGSTOPped, so the deploy,
once it has recorded the version as DEPLOYING in Redis (seen there), waits on the worker's profile
load; then the router is SIGKILLed. The client's Deploy fails Unavailable (retriable); the router
restarted over the same Redis and home says why the version did not come back (FAILED, "the deploy
was interrupted by a restart of the router"), serves nothing half-loaded, and the retried deploy
serves (the interrupted version is then retired: a newer one serves in its place).
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import numpy as np
import psutil
import pytest
import redis
import tritonclient.grpc as triton
import yaml
from opml.inference.v1 import deployments_pb2 as pb

from opml_common.errors import OpmlError, Unavailable
from opml_devstack.testing.bus import poll_until
from opml_devstack.testing.services import TOKENS, ServiceStarter
from opml_inference_router.testing import mlp_config, worker_processes, write_model_dir
from opml_inference_router_contract.client import DeploymentClient

FLEET = {
    "pool_kinds": [{"name": "cpu", "precisions": ["fp32"], "memory_mib": 2048, "slots": 2, "cost_per_hour": 0.4,
                    "execution_provider": "CPUExecutionProvider"}],
    "pools": [{"name": "cpu", "kind": "cpu", "workers": 1}],
    "min_replicas": 1,
}


@pytest.mark.timeout(300)
def test_a_router_killed_mid_deploy_restarts_with_no_half_state_and_the_retry_serves(
        start_service: ServiceStarter, tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump(FLEET))
    env = start_service.env("inference-router", extra_env={"OPML_INFERENCE_ROUTER_FLEET": str(fleet),
                                                          "OPML_INFERENCE_ROUTER_WORKER_THREADS_PER_REPLICA": "1"})
    model_dir = write_model_dir(tmp_path / "mlp", mlp_config("mlp", pool_kinds=("cpu",), precisions=("fp32",)))
    store = redis.Redis.from_url(env["OPML_REDIS_URL"])
    key = f"{env['OPML_REDIS_PREFIX']}inference-router:deployments"

    router = start_service("inference-router", env=env)
    [worker] = worker_processes(router.process.pid)
    outcome: list[BaseException | None] = []

    def deploy() -> None:
        try:
            with DeploymentClient(router.target, token=TOKENS["writer"]) as client:
                client.deploy(model_dir=str(model_dir))
            outcome.append(None)
        except OpmlError as error:
            outcome.append(error)

    os.kill(worker.pid, signal.SIGSTOP)  # the deploy's profile load on it waits
    try:
        caller = threading.Thread(target=deploy)
        caller.start()
        poll_until(lambda: (raw := store.hget(key, "mlp")) and json.loads(raw)["versions"][0]["state"] == "DEPLOYING",
                   timeout_s=60, what="the deploy recording the version as DEPLOYING", every_s=0.02)
        router.kill()  # SIGKILL, mid-deploy
        caller.join(timeout=60)
    finally:
        if worker.is_running():
            os.kill(worker.pid, signal.SIGCONT)  # it exits by itself: its router is gone
    assert len(outcome) == 1 and isinstance(outcome[0], Unavailable) and outcome[0].retriable, outcome
    psutil.wait_procs([worker], timeout=30)

    router = start_service("inference-router", env=env)  # the same home, ports and Redis keys
    with DeploymentClient(router.target, token=TOKENS["writer"]) as client:
        [interrupted] = client.get("mlp").versions
        assert (interrupted.version, interrupted.state) == (1, pb.FAILED)
        assert interrupted.reason == "the deploy was interrupted by a restart of the router"
        assert not interrupted.replicas
        retried = client.deploy(model_dir=str(model_dir))  # the client's retry
        assert [(v.version, v.state) for v in retried.versions] == [(2, pb.SERVING)]
    data = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)
    with triton.InferenceServerClient(router.target) as kserve:
        tensor = triton.InferInput("features", list(data.shape), "FP32")
        tensor.set_data_from_numpy(data)
        result = kserve.infer("mlp", [tensor], headers={"authorization": f"Bearer {TOKENS['writer']}"})
    assert result.as_numpy("scores").shape == (2, 4) and result.get_response().model_version == "2"
    store.close()
