"""An in-memory stand-in for the Kubernetes core API (``CoreV1Api``), for tests: no cluster runs here.

It keeps the objects it is given, answers create/list/read/delete as the API server does (the
client's own model objects; 404, 409 and 400 as ``ApiException``), and has a kubelet that a test
drives by hand (:meth:`~FakeCoreV1Api.set_running`, :meth:`~FakeCoreV1Api.set_exited`,
:meth:`~FakeCoreV1Api.set_waiting`, :meth:`~FakeCoreV1Api.evict`, :meth:`~FakeCoreV1Api.vanish`).
Given ``run_commands_in`` (a folder for their logs), the kubelet instead runs each pod's container
command as a local process with the pod's environment (its output is the pod's log, its exit code the container's, a
signal ``128 + n`` as in a container), and deleting a pod sends SIGTERM, then SIGKILL after the
grace period, as a kubelet does; the executor conformance suite runs the same programs on every
executor this way. What it does not model: scheduling, images, DNS, networking between pods.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import threading
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException


class FakeCoreV1Api:
    """The ``CoreV1Api`` calls the Kubernetes executor makes, against objects kept in memory."""

    def __init__(self, *, run_commands_in: Path | None = None, node: str = "node-0") -> None:
        self.pods: dict[str, dict[str, Any]] = {}
        self.services: dict[str, dict[str, Any]] = {}
        self.secrets: dict[str, dict[str, Any]] = {}
        self.deletions: list[tuple[str, int | None]] = []
        """``(pod name, grace_period_seconds)`` of every pod deletion asked for."""
        self.reject: dict[str, ApiException] = {}
        """Object name -> the error its creation fails with (an invalid manifest, an API server away)."""
        self._node = node
        self._logs: dict[str, str] = {}
        self._processes: dict[str, subprocess.Popen[bytes]] = {}
        self._log_dir = run_commands_in
        self._lock = threading.RLock()
        self._client = ApiClient()

    # -- the API server ------------------------------------------------------------------------

    def create_namespaced_service(self, namespace: str, body: dict[str, Any]) -> Any:
        with self._lock:
            name = self._admit(body, self.services)
            self.services[name] = copy.deepcopy(body)
            return self._model(self.services[name], "V1Service")

    def create_namespaced_secret(self, namespace: str, body: dict[str, Any]) -> Any:
        with self._lock:
            name = self._admit(body, self.secrets)
            self.secrets[name] = copy.deepcopy(body)
            return self._model({**self.secrets[name], "stringData": None}, "V1Secret")

    def delete_namespaced_secret(self, name: str, namespace: str) -> None:
        with self._lock:
            if self.secrets.pop(name, None) is None:
                raise _error(404, "Not Found", f'secrets "{name}" not found')

    def create_namespaced_pod(self, namespace: str, body: dict[str, Any]) -> Any:
        with self._lock:
            name = self._admit(body, self.pods)
            pod = self.pods[name] = copy.deepcopy(body)
            pod["status"] = {"phase": "Pending"}
            if self._log_dir is not None:
                self._start(name, pod)
            return self._model(pod, "V1Pod")

    def list_namespaced_pod(self, namespace: str, label_selector: str | None = None) -> Any:
        with self._lock:
            wanted = dict(term.split("=", 1) for term in label_selector.split(",")) if label_selector else {}
            items = [pod for pod in self.pods.values()
                     if wanted.items() <= (pod["metadata"].get("labels") or {}).items()]
            return self._model({"items": items}, "V1PodList")

    def read_namespaced_pod_log(self, name: str, namespace: str, container: str | None = None,
                                _preload_content: bool = True) -> Any:
        """The log as text, or with ``_preload_content=False`` the raw response (its bytes in ``.data``)."""
        with self._lock:
            pod = self._get(name)
            if pod["status"]["phase"] == "Pending":
                raise _error(400, "Bad Request", f'container "{container}" in pod "{name}" is waiting to start')
            if self._log_dir is not None:
                data = (self._log_dir / f"{name}.log").read_bytes()
            else:
                data = self._logs.get(name, "").encode()
            return data.decode(errors="replace") if _preload_content else SimpleNamespace(data=data)

    def delete_namespaced_pod(self, name: str, namespace: str, grace_period_seconds: int | None = None) -> None:
        with self._lock:
            pod = self._get(name)
            self.deletions.append((name, grace_period_seconds))
            process = self._processes.get(name)
            if process is None or process.poll() is not None:
                del self.pods[name]
                return
            pod["metadata"]["deletionTimestamp"] = datetime.now(UTC).isoformat()
            _signal_group(process, signal.SIGTERM)
        threading.Thread(target=self._kill_after, args=(name, process, grace_period_seconds or 0),
                         daemon=True).start()

    def delete_namespaced_service(self, name: str, namespace: str) -> None:
        with self._lock:
            if self.services.pop(name, None) is None:
                raise _error(404, "Not Found", f'services "{name}" not found')

    # -- the kubelet, driven by a test ---------------------------------------------------------

    def set_running(self, name: str) -> None:
        with self._lock:
            pod = self._get(name)
            pod["spec"]["nodeName"] = self._node
            pod["status"] = {"phase": "Running", "containerStatuses": [self._container(pod, {"running": {}})]}

    def set_exited(self, name: str, exit_code: int, reason: str | None = None) -> None:
        with self._lock:
            pod = self.pods.get(name)
            if pod is None:
                return
            pod["spec"].setdefault("nodeName", self._node)
            reason = reason or ("Completed" if exit_code == 0 else "Error")
            terminated = {"exitCode": exit_code, "reason": reason}
            pod["status"] = {"phase": "Succeeded" if exit_code == 0 else "Failed",
                             "containerStatuses": [self._container(pod, {"terminated": terminated})]}

    def set_waiting(self, name: str, reason: str, message: str = "") -> None:
        with self._lock:
            pod = self._get(name)
            waiting = {"reason": reason, "message": message}
            pod["status"] = {"phase": "Pending", "containerStatuses": [self._container(pod, {"waiting": waiting})]}

    def evict(self, name: str) -> None:
        with self._lock:
            self._get(name)["status"] = {"phase": "Failed", "reason": "Evicted",
                                         "message": "The node was low on resource: memory."}

    def vanish(self, name: str) -> None:
        """The pod is gone without the executor asking (deleted by someone, its node removed)."""
        with self._lock:
            del self.pods[name]

    def write_log(self, name: str, text: str) -> None:
        with self._lock:
            self._logs[name] = self._logs.get(name, "") + text

    def close(self) -> None:
        """Kill every process the kubelet still runs."""
        for process in list(self._processes.values()):
            if process.poll() is None:
                _signal_group(process, signal.SIGKILL)
                process.wait()

    # -- helpers -------------------------------------------------------------------------------

    def _admit(self, body: dict[str, Any], store: dict[str, Any]) -> str:
        name = body["metadata"]["name"]
        if name in self.reject:
            raise self.reject[name]
        if name in store:
            raise _error(409, "Conflict", f'{body["kind"].lower()}s "{name}" already exists')
        return name

    def _get(self, name: str) -> dict[str, Any]:
        pod = self.pods.get(name)
        if pod is None:
            raise _error(404, "Not Found", f'pods "{name}" not found')
        return pod

    def _container(self, pod: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
        container = pod["spec"]["containers"][0]
        return {"name": container["name"], "image": container["image"], "imageID": "", "ready": "running" in state,
                "restartCount": 0, "state": state}

    def _model(self, data: dict[str, Any], kind: str) -> Any:
        return self._client.deserialize(json.dumps(data), kind, "application/json")

    def _start(self, name: str, pod: dict[str, Any]) -> None:
        assert self._log_dir is not None
        self._log_dir.mkdir(parents=True, exist_ok=True)
        container = pod["spec"]["containers"][0]
        env = dict(os.environ)
        for source in container.get("envFrom", []):  # a Secret's keys, under the container's own env
            env.update(self.secrets.get(source["secretRef"]["name"], {}).get("stringData", {}))
        env.update({e["name"]: e["value"] for e in container.get("env", [])})
        with (self._log_dir / f"{name}.log").open("wb") as log:
            process = subprocess.Popen(container["command"], env=env, stdin=subprocess.DEVNULL, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        self._processes[name] = process
        self.set_running(name)
        threading.Thread(target=self._reap, args=(name, process), daemon=True).start()

    def _reap(self, name: str, process: subprocess.Popen[bytes]) -> None:
        code = process.wait()
        self.set_exited(name, code if code >= 0 else 128 - code)

    def _kill_after(self, name: str, process: subprocess.Popen[bytes], grace_s: int) -> None:
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(process, signal.SIGKILL)
            process.wait()
        with self._lock:
            self.pods.pop(name, None)


def _error(status: int, reason: str, message: str) -> ApiException:
    exc = ApiException(status=status, reason=reason)
    exc.body = json.dumps({"kind": "Status", "status": "Failure", "message": message, "code": status})
    return exc


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
