"""The CUDA devices of this machine, and handing them out one process at a time.

Discovery asks ``nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader,nounits``;
where ``CUDA_VISIBLE_DEVICES`` is set, only the devices it lists count (by index; ``""`` or ``-1``:
none), so a process already given some devices hands out only those. No ``nvidia-smi`` (or one that
fails) means no devices, unless ``CUDA_VISIBLE_DEVICES`` names them, which is then believed with an
unknown name and memory. A process is pinned to its devices with ``CUDA_VISIBLE_DEVICES``
(:func:`visible_devices_env`); inside it, the first of them is CUDA device 0.

:class:`DevicePool` is what the inference router's gpu pool and the job-orchestrator's local executor
share: which devices are free, taken all or nothing, given back exactly.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from opml_common.errors import FailedPrecondition, InvalidArgument

VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
QUERY = ("--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits")


@dataclass(frozen=True, slots=True)
class GpuDevice:
    """One CUDA device: its index on the machine, its name (``NVIDIA H100 80GB HBM3``) and memory."""

    index: int
    name: str
    memory_mib: int

    def describe(self) -> str:
        """``GPU 0 (NVIDIA H100 80GB HBM3, 81559 MiB)``: for messages and logs."""
        memory = f", {self.memory_mib} MiB" if self.memory_mib else ""
        return f"GPU {self.index} ({self.name or 'unknown'}{memory})"


def parse_nvidia_smi(text: str) -> list[GpuDevice]:
    """The devices of ``nvidia-smi``'s CSV (index, name, memory.total in MiB), one a line.

    Raises:
        InvalidArgument: a line that is not three fields with an integer index and memory.
    """
    devices = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        parts = [part.strip() for part in line.split(",")]
        if len(parts) != 3:
            raise InvalidArgument(f"nvidia-smi line {number}", f"must be index, name, memory.total, but got {line!r}")
        index, name, memory = parts
        try:
            devices.append(GpuDevice(int(index), name, int(float(memory.removesuffix("MiB").strip()))))
        except ValueError:
            raise InvalidArgument(f"nvidia-smi line {number}",
                                  f"must have an integer index and memory in MiB, but got {line!r}") from None
    return devices


def parse_visible(value: str) -> list[int]:
    """The device indices ``CUDA_VISIBLE_DEVICES`` lists ([] for none; CUDA stops at the first
    negative entry).

    Raises:
        InvalidArgument: an entry that is not an index (UUIDs and MIG names are not handed out here).
    """
    indices: list[int] = []
    for entry in (part.strip() for part in value.split(",")):
        if not entry:
            continue
        try:
            index = int(entry)
        except ValueError:
            raise InvalidArgument(VISIBLE_DEVICES, f"must list device indices, but has {entry!r}") from None
        if index < 0:
            break
        indices.append(index)
    return indices


def _run_nvidia_smi() -> str | None:
    """nvidia-smi's answer, or None when it is not installed or fails (no driver, no device)."""
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return None
    try:
        done = subprocess.run([binary, *QUERY], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def discover(env: Mapping[str, str] | None = None,
             query: Callable[[], str | None] = _run_nvidia_smi) -> list[GpuDevice]:
    """This machine's CUDA devices, as the module says (``env``: default ``os.environ``; ``query``:
    what nvidia-smi prints, None without it)."""
    env = os.environ if env is None else env
    answer = query()
    found = parse_nvidia_smi(answer) if answer is not None else []
    if VISIBLE_DEVICES not in env:
        return found
    visible = parse_visible(env[VISIBLE_DEVICES])
    by_index = {device.index: device for device in found}
    return [by_index.get(index, GpuDevice(index, "", 0)) for index in visible]


def visible_devices_env(devices: Iterable[GpuDevice]) -> dict[str, str]:
    """The environment that pins a process to ``devices`` (none: it sees no device at all)."""
    return {VISIBLE_DEVICES: ",".join(str(device.index) for device in devices)}


class DevicePool:
    """Which of a set of devices are free; :meth:`take` is all or nothing, :meth:`give_back` exact.

    Not thread-safe: its owner serializes the calls (one event loop, one constructor)."""

    def __init__(self, devices: Sequence[GpuDevice]) -> None:
        self.devices = tuple(devices)
        self._free = list(self.devices)

    @property
    def free(self) -> tuple[GpuDevice, ...]:
        return tuple(self._free)

    def take(self, count: int, *, who: str) -> tuple[GpuDevice, ...]:
        """``count`` free devices for ``who``, lowest indices first.

        Raises:
            FailedPrecondition: fewer than ``count`` are free (saying how many there are and are free).
        """
        if count > len(self._free):
            raise FailedPrecondition(f"{who} needs {count} GPU{'s' if count != 1 else ''}, but "
                                     f"{len(self._free)} of this machine's {len(self.devices)} are free")
        taken, self._free = tuple(self._free[:count]), self._free[count:]
        return taken

    def give_back(self, devices: Iterable[GpuDevice]) -> None:
        """Frees ``devices`` (each once; ones already free or never this pool's are ignored)."""
        for device in devices:
            if device in self.devices and device not in self._free:
                self._free.append(device)
        self._free.sort(key=lambda device: device.index)
