"""The gpu pool up to the provider choice, on a machine without CUDA: which pools start and why not,
one device per worker (its environment), the session's provider and its refused CPU fallback, fp16,
and a real worker process of a CUDA kind refusing to start where onnxruntime lacks the provider.

Devices and providers are given to :class:`PoolManager` (what discovery and onnxruntime would say on
a GPU machine). On a real card, bench/inference_router_gpu.py checks the rest before it measures: the
gpu worker's replica on KIND_GPU in fp16, its outputs within fp16's error of the cpu worker's
(a test here that needs a card would be skipped everywhere else, and a skip fails this suite).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import onnxruntime as ort
import pytest
import yaml
from prometheus_client import CollectorRegistry

from opml_common.config import PlatformSettings
from opml_common.errors import FailedPrecondition
from opml_common.gpus import GpuDevice
from opml_common.metrics import ServiceMetrics
from opml_inference_router.control import PoolManager
from opml_inference_router.control.pools import unavailable_reasons
from opml_inference_router.hosts.agent import HostAgent
from opml_inference_router.hosts.settings import HostAgentSettings
from opml_inference_router.placement import FleetConfig
from opml_inference_router.placement.fleet_config import PoolKind
from opml_inference_router.runtime import build_session, choose_precision, require_provider
from opml_inference_router.runtime.session import check_placed, providers
from opml_inference_router.testing import mlp_classifier, mlp_config
from opml_inference_router.worker.__main__ import pinned_device
from opml_inference_router.worker.process import WorkerProcess
from opml_inference_router_contract.model_config import ModelConfig

CUDA, CPU_EP = "CUDAExecutionProvider", "CPUExecutionProvider"
FLEET = {
    "pool_kinds": [{"name": "cpu", "precisions": ["fp32"], "memory_mib": 2048, "slots": 2, "cost_per_hour": 0.4,
                    "execution_provider": CPU_EP},
                   {"name": "gpu", "precisions": ["fp32", "fp16"], "memory_mib": 16384, "slots": 4,
                    "cost_per_hour": 2.0, "execution_provider": CUDA}],
    "pools": [{"name": "cpu", "kind": "cpu", "workers": 1}, {"name": "gpu", "kind": "gpu", "workers": 2}],
}
GPU_KIND = PoolKind.model_validate(FLEET["pool_kinds"][1])
CARDS = [GpuDevice(0, "NVIDIA H100 80GB HBM3", 81559), GpuDevice(1, "NVIDIA H100 80GB HBM3", 81559),
         GpuDevice(3, "NVIDIA A10", 23028)]


def manager(tmp_path: Path, fleet: dict, *, providers: list[str], devices: list[GpuDevice] | None) -> PoolManager:
    return PoolManager(FleetConfig.from_dict(fleet), tmp_path / "fleet.yaml", work_dir=tmp_path,
                       metrics=ServiceMetrics("inference-router", registry=CollectorRegistry()),
                       providers=providers, devices=devices)


def test_each_gpu_worker_is_pinned_to_a_device_of_its_own(tmp_path: Path) -> None:
    pools = manager(tmp_path, FLEET, providers=[CUDA, CPU_EP], devices=CARDS)
    assert pools.unavailable_kinds == []
    by_id = {w.worker.id: w for w in pools.workers()}
    assert set(by_id) == {"cpu-000", "gpu-000", "gpu-001"}
    assert [by_id[i].process.env.get("CUDA_VISIBLE_DEVICES") for i in ("gpu-000", "gpu-001")] == ["0", "1"]
    assert [by_id[i].device for i in ("gpu-000", "gpu-001")] == CARDS[:2]
    assert "CUDA_VISIBLE_DEVICES" not in by_id["cpu-000"].process.env and by_id["cpu-000"].device is None
    assert by_id["gpu-000"].process.env["OPML_AUTH_TOKENS"] == by_id["cpu-000"].process.env["OPML_AUTH_TOKENS"]


def test_more_gpu_workers_than_devices_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FailedPrecondition, match=r"ask for 2 workers \(gpu: 2\), one device each, but this machine "
                                                 r"has 1 \(GPU 3 \(NVIDIA A10, 23028 MiB\)\)"):
        manager(tmp_path, FLEET, providers=[CUDA, CPU_EP], devices=CARDS[2:])


@pytest.mark.parametrize(("providers", "devices", "reason"), [
    ([CPU_EP], CARDS, r"CUDAExecutionProvider is not in this onnxruntime .*install the router's gpu extra"),
    ([CUDA, CPU_EP], [], "no CUDA device found"),
])
def test_a_gpu_pool_that_cannot_run_is_left_out_saying_why(tmp_path: Path, providers, devices, reason) -> None:
    pools = manager(tmp_path, FLEET, providers=providers, devices=devices)
    assert [w.worker.id for w in pools.workers()] == ["cpu-000"]
    assert not any(w.kind.name == "gpu" for w in pools.fleet.workers)  # placement never sees it
    assert pools.unavailable_kinds == ["gpu"]
    assert re.search(reason, pools.unavailable_reasons["gpu"])


def test_a_gpu_only_fleet_without_a_device_says_why_it_cannot_run(tmp_path: Path) -> None:
    fleet = {**FLEET, "pools": [{"name": "gpu", "kind": "gpu", "workers": 1}]}
    with pytest.raises(FailedPrecondition, match="no pool of .* can run here: gpu: no CUDA device found"):
        manager(tmp_path, fleet, providers=[CUDA, CPU_EP], devices=[])


def test_a_gpu_pool_at_another_site_needs_no_local_device(tmp_path: Path) -> None:
    """A host agent's gpu pool is in the fleet whatever this machine has; no local device is taken for it."""
    fleet = {**FLEET, "pools": [{"name": "cpu", "kind": "cpu", "workers": 1},
                                {"name": "cloud-gpu", "kind": "gpu", "workers": 2, "site": "cloud"}]}
    pools = manager(tmp_path, fleet, providers=[CPU_EP], devices=[])
    assert [w.id for w in pools.fleet.workers if w.kind.name == "gpu"] == ["cloud-gpu-000", "cloud-gpu-001"]
    assert [w.worker.id for w in pools.workers()] == ["cpu-000"]


def test_reasons_per_kind() -> None:
    config = FleetConfig.from_dict(FLEET)
    assert unavailable_reasons(config, {CUDA, CPU_EP}, CARDS) == {}
    assert set(unavailable_reasons(config, {CPU_EP}, [])) == {"gpu"}


def test_a_cuda_session_asks_for_device_zero_and_never_falls_back_to_the_cpu() -> None:
    assert providers(GPU_KIND) == [(CUDA, {"device_id": "0"})]
    check_placed([CUDA, CPU_EP], GPU_KIND)  # CPU for the nodes CUDA lacks is onnxruntime's own, and fine
    with pytest.raises(FailedPrecondition, match="placed the session on CPUExecutionProvider"):
        check_placed([CPU_EP], GPU_KIND)
    assert CUDA not in ort.get_available_providers(), "this test is about a machine without onnxruntime-gpu"
    # onnxruntime itself only warns that CUDA is missing and builds the session on the CPU: refused here.
    with pytest.raises(FailedPrecondition, match="pool kind gpu runs on CUDAExecutionProvider, but onnxruntime "
                                                 "placed the session on CPUExecutionProvider"):
        build_session(mlp_classifier(features=8).SerializeToString(), GPU_KIND, threads=1, source="m",
                      folder=Path("."))
    with pytest.raises(FailedPrecondition, match="install the router's gpu extra"):
        require_provider(GPU_KIND)


def test_gpu_serves_fp16_where_the_model_allows_it() -> None:
    assert choose_precision(ModelConfig.from_dict(mlp_config("m", precisions=("fp32", "fp16"))), GPU_KIND) == "fp16"
    assert choose_precision(ModelConfig.from_dict(mlp_config("m", precisions=("fp32",))), GPU_KIND) == "fp32"


def test_the_worker_runs_on_the_first_device_it_sees() -> None:
    assert pinned_device(GPU_KIND, {"CUDA_VISIBLE_DEVICES": "3"}, devices=CARDS[2:]) == CARDS[2]
    with pytest.raises(FailedPrecondition, match=r"sees no CUDA device \(CUDA_VISIBLE_DEVICES=''"):
        pinned_device(GPU_KIND, {"CUDA_VISIBLE_DEVICES": ""}, devices=[])
    cpu_kind = PoolKind.model_validate(FLEET["pool_kinds"][0])
    assert pinned_device(cpu_kind, {}, devices=[]) is None


def test_a_gpu_worker_process_without_cuda_refuses_to_start_saying_why(tmp_path: Path) -> None:
    """The real worker program, started as the pool manager starts a gpu worker (pinned to a device),
    on an onnxruntime without CUDA: it exits before serving, naming the provider and the extra."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump(FLEET))
    pools = manager(tmp_path, FLEET, providers=[CUDA, CPU_EP], devices=CARDS)
    process: WorkerProcess = next(w.process for w in pools.workers() if w.worker.id == "gpu-001")
    process.fleet, process.uds = fleet, None
    with pytest.raises(RuntimeError, match=r"(?s)before serving.*pool kind gpu needs CUDAExecutionProvider, "
                                           r"which this onnxruntime build lacks \(onnxruntime-gpu has it"):
        process.start()
    assert process.env["CUDA_VISIBLE_DEVICES"] == "1"


async def test_a_host_agent_pins_its_gpu_pool_worker_and_refuses_one_without_a_device(tmp_path: Path) -> None:
    """A GPU host's agent: its gpu pool's worker gets a device of the host's own; no device, no agent."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump({**FLEET, "pools": [
        {"name": "cloud-cpu", "kind": "cpu", "workers": 2, "site": "cloud"},
        {"name": "cloud-gpu", "kind": "gpu", "workers": 2, "site": "cloud"}]}))
    settings = HostAgentSettings(router_target="127.0.0.1:1", fleet=fleet, pools="cloud-cpu,cloud-gpu",
                                 home=tmp_path / "host")
    metrics = ServiceMetrics("inference-router-host", registry=CollectorRegistry())
    agent = HostAgent(settings, PlatformSettings(), metrics, devices=CARDS[2:])
    try:
        env = {worker.pool: worker.process.env for worker in agent.workers}
        assert env == {"cloud-cpu": {}, "cloud-gpu": {"CUDA_VISIBLE_DEVICES": "3"}}
    finally:  # never started: what its constructor made goes here (stop() undoes only a start)
        await agent.router.close()
        await agent._channel.close()
        for worker in agent.workers:
            shutil.rmtree(worker.process.uds.parent)
    with pytest.raises(FailedPrecondition, match=r"pools cloud-gpu run on CUDAExecutionProvider, one device each, "
                                                 r"but this host has 0 \(none found\)"):
        HostAgent(settings, PlatformSettings(), metrics, devices=[])

