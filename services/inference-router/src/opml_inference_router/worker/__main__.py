"""Run a worker: ``python -m opml_inference_router.worker --pool-kind cpu --fleet fleet.yaml --port 0``.

Once serving, the worker writes one JSON line to stdout, ``{"grpc_port": .., "metrics_port": ..,
"pool_kind": .., "pid": ..}`` (with ``"device": name`` on a CUDA kind's worker, the device it is
pinned to; ``"uds": path`` when it also serves its local data plane on a Unix domain socket,
``--uds``: :mod:`.uds`), so a parent that asked for port 0 learns the bound
ports (logs go to stderr). SIGTERM or SIGINT: health turns NOT_SERVING, in-flight calls finish
within the grace period, queued requests are run, then the replicas are released.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from tritonclient.grpc import service_pb2, service_pb2_grpc

from opml_common.config import PlatformSettings
from opml_common.errors import FailedPrecondition, InvalidArgument, OpmlError
from opml_common.gpus import VISIBLE_DEVICES, GpuDevice, discover
from opml_common.grpc.server import GrpcServer, ServiceRegistration, wait_for_signal
from opml_common.logging import configure_logging
from opml_common.metrics import ServiceMetrics
from opml_inference_router import package_version
from opml_inference_router.kserve.roles import INFERENCE_METHOD_ROLES
from opml_inference_router.placement.fleet_config import PoolKind, load_fleet_config
from opml_inference_router.runtime import ModelRepository, WorkerMetrics, require_provider, thread_share
from opml_inference_router.runtime.session import CUDA
from opml_inference_router.worker import uds
from opml_inference_router.worker.process import MAX_UDS_PATH
from opml_inference_router.worker.servicer import WorkerServicer
from opml_inference_router.worker.settings import WorkerSettings
from opml_inference_router_contract.names import SERVICE

METRICS_NAMESPACE = "inference-router-worker"  # opml_inference_router_worker_*: apart from the router's
SERVER_NAME = "opml-inference-router-worker"

log = logging.getLogger(__name__)


def pool_kind(settings: WorkerSettings) -> PoolKind:
    """The kind this worker is, from the fleet file.

    Raises:
        InvalidArgument: no fleet file given, or it does not declare the kind.
        FailedPrecondition: this onnxruntime build lacks the kind's execution provider.
    """
    if settings.fleet is None:
        raise InvalidArgument("--fleet", "is required: the fleet file declares the pool kinds")
    kinds = {kind.name: kind for kind in load_fleet_config(settings.fleet).pool_kinds}
    if settings.pool_kind not in kinds:
        raise InvalidArgument("--pool-kind", f"must be a kind {settings.fleet} declares ({', '.join(kinds)}), "
                                             f"but got {settings.pool_kind!r}")
    kind = kinds[settings.pool_kind]
    require_provider(kind)
    return kind


def pinned_device(kind: PoolKind, env: Mapping[str, str] | None = None,
                  devices: Sequence[GpuDevice] | None = None) -> GpuDevice | None:
    """The CUDA device a worker of a CUDA kind runs its sessions on: the first it sees (device 0 after
    ``CUDA_VISIBLE_DEVICES``, which the pool manager sets to one); None for other kinds.

    Raises:
        FailedPrecondition: a CUDA kind and no device is visible.
    """
    if kind.execution_provider != CUDA:
        return None
    env = os.environ if env is None else env
    found = discover(env) if devices is None else list(devices)
    if not found:
        mask = f"CUDA_VISIBLE_DEVICES={env[VISIBLE_DEVICES]!r}" if VISIBLE_DEVICES in env else \
            "CUDA_VISIBLE_DEVICES unset"
        raise FailedPrecondition(f"pool kind {kind.name} runs on {CUDA}, but this process sees no CUDA device "
                                 f"({mask}; nvidia-smi lists none or is not installed)")
    return found[0]


async def serve(settings: WorkerSettings, platform: PlatformSettings) -> None:
    """Serve until SIGINT/SIGTERM."""
    kind = pool_kind(settings)
    device = pinned_device(kind)
    if device is not None:
        log.info("pool kind %s on %s", kind.name, device.describe())
    if settings.uds is not None:
        check_uds_path(settings.uds)
    metrics = ServiceMetrics(METRICS_NAMESPACE)
    repository = ModelRepository(kind, metrics=WorkerMetrics(metrics), models_dir=settings.models_dir,
                                 threads=settings.threads_per_replica or thread_share(kind),
                                 profile_repeats=settings.profile_repeats)
    servicer = WorkerServicer(repository, server_name=SERVER_NAME, server_version=package_version())
    registration = ServiceRegistration(service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"],
                                       service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server, servicer,
                                       INFERENCE_METHOD_ROLES)
    server = GrpcServer(settings=settings, platform=platform, metrics=metrics, registrations=[registration])
    announcement: dict[str, object] = {"pool_kind": kind.name, "pid": os.getpid()}
    if device is not None:
        announcement["device"] = device.name
    try:
        async with server, contextlib.AsyncExitStack() as local:
            if settings.uds is not None:
                await local.enter_async_context(uds.serving(servicer, settings.uds, metrics=metrics,
                                                            grace_s=settings.shutdown_grace_s))
                announcement["uds"] = str(settings.uds)
            print(json.dumps({"grpc_port": server.port, "metrics_port": server.metrics_port, **announcement}),
                  flush=True)
            await until_stopped(settings.parent_pid)
    finally:
        await repository.close()


async def until_stopped(parent_pid: int | None, *, check_s: float = 1.0) -> None:
    """Return on SIGINT/SIGTERM, or once ``parent_pid`` is no longer our parent (it died)."""
    signalled = asyncio.ensure_future(wait_for_signal())
    try:
        while not signalled.done():
            if parent_pid is not None and os.getppid() != parent_pid:
                log.warning("the router (pid %d) is gone: stopping", parent_pid)
                return
            await asyncio.wait({signalled}, timeout=check_s)
    finally:
        signalled.cancel()


def check_uds_path(path: Path) -> None:
    """Raises: InvalidArgument when ``path`` cannot be a socket address or its directory is missing."""
    if len(os.fsencode(path)) > MAX_UDS_PATH:
        raise InvalidArgument("--uds", f"must be at most {MAX_UDS_PATH} bytes (a socket address), "
                                       f"but got {len(os.fsencode(path))}: {path}")
    if not path.parent.is_dir():
        raise InvalidArgument("--uds", f"must be in an existing directory, but {path.parent} is not one")


def parse_settings(argv: list[str]) -> WorkerSettings:
    """Flags override the environment's OPML_INFERENCE_ROUTER_WORKER_* settings."""
    parser = argparse.ArgumentParser(prog="python -m opml_inference_router.worker", description=__doc__.split("\n")[0])
    parser.add_argument("--pool-kind", help="pool kind this worker is (declared in --fleet)")
    parser.add_argument("--fleet", type=Path, help="fleet file declaring the pool kinds")
    parser.add_argument("--port", type=int, dest="grpc_port", help="gRPC port (0: pick a free one)")
    parser.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (0: pick a free one)")
    parser.add_argument("--host", help="interface to bind")
    parser.add_argument("--uds", type=Path, help="also serve inference on this Unix domain socket "
                        "(the local router's cheaper hop, see worker/uds.py)")
    parser.add_argument("--models-dir", type=Path, help="directory of model bundles loaded by name")
    parser.add_argument("--threads-per-replica", type=int, help="intra-op threads per replica (0: auto)")
    parser.add_argument("--parent-pid", type=int, help="exit when this process is gone (the router that started us)")
    given = {key: value for key, value in vars(parser.parse_args(argv)).items() if value is not None}
    return WorkerSettings(**given)


def main() -> None:
    settings = parse_settings(sys.argv[1:])
    platform = PlatformSettings()
    configure_logging(SERVICE, level=platform.log_level, fmt=platform.log_format)
    try:
        asyncio.run(serve(settings, platform))
    except OpmlError as error:  # a misconfigured worker says why in one line instead of a traceback
        sys.exit(f"{SERVER_NAME} cannot start: {error.message}")


if __name__ == "__main__":
    main()
