"""Device discovery (nvidia-smi, CUDA_VISIBLE_DEVICES) and the device pool, with nvidia-smi's answers faked."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from opml_common.errors import FailedPrecondition, InvalidArgument
from opml_common.gpus import DevicePool, GpuDevice, discover, parse_nvidia_smi, parse_visible, visible_devices_env

SMI = "0, NVIDIA H100 80GB HBM3, 81559\n1, NVIDIA H100 80GB HBM3, 81559\n2, NVIDIA A10, 23028\n"
H100_0, H100_1, A10 = GpuDevice(0, "NVIDIA H100 80GB HBM3", 81559), GpuDevice(1, "NVIDIA H100 80GB HBM3", 81559), \
    GpuDevice(2, "NVIDIA A10", 23028)


def test_nvidia_smi_lines_are_devices():
    assert parse_nvidia_smi(SMI) == [H100_0, H100_1, A10]
    assert parse_nvidia_smi("0, Tesla T4, 15360 MiB\n\n") == [GpuDevice(0, "Tesla T4", 15360)]
    with pytest.raises(InvalidArgument, match="line 2"):
        parse_nvidia_smi("0, T4, 15360\nNo devices were found\n")


def test_no_nvidia_smi_no_devices():
    assert discover({}, query=lambda: None) == []


def test_visible_devices_restrict_what_is_found():
    assert discover({}, query=lambda: SMI) == [H100_0, H100_1, A10]
    assert discover({"CUDA_VISIBLE_DEVICES": "2,0"}, query=lambda: SMI) == [A10, H100_0]
    assert discover({"CUDA_VISIBLE_DEVICES": ""}, query=lambda: SMI) == []
    assert discover({"CUDA_VISIBLE_DEVICES": "1,-1,2"}, query=lambda: SMI) == [H100_1]  # CUDA stops at -1
    # Without nvidia-smi (a container given devices by index), the list is believed, unnamed.
    assert discover({"CUDA_VISIBLE_DEVICES": "3"}, query=lambda: None) == [GpuDevice(3, "", 0)]
    with pytest.raises(InvalidArgument, match="CUDA_VISIBLE_DEVICES"):
        parse_visible("GPU-8a1b2c3d")


def test_discover_runs_nvidia_smi_from_path(tmp_path, monkeypatch):
    """The real query path: a program named nvidia-smi on PATH is asked for the CSV."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!{sys.executable}\nimport sys\n"
                    "assert sys.argv[1:] == ['--query-gpu=index,name,memory.total', '--format=csv,noheader,nounits']\n"
                    "print('0, NVIDIA L4, 23034')\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert discover({}) == [GpuDevice(0, "NVIDIA L4", 23034)]
    fake.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")  # a driver that is not loaded
    assert discover({}) == []


def test_pinned_process_sees_its_devices():
    env = {**os.environ, **visible_devices_env([A10])}
    seen = subprocess.run([sys.executable, "-c", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"],
                          env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert seen == "2"
    assert visible_devices_env([]) == {"CUDA_VISIBLE_DEVICES": ""}


def test_pool_takes_all_or_nothing_and_gives_back_exactly():
    pool = DevicePool([H100_0, H100_1, A10])
    first = pool.take(2, who="job a")
    assert first == (H100_0, H100_1) and pool.free == (A10,)
    with pytest.raises(FailedPrecondition, match=r"job b needs 2 GPUs, but 1 of this machine's 3 are free"):
        pool.take(2, who="job b")
    assert pool.free == (A10,)  # nothing taken by the refusal
    pool.give_back(first)
    pool.give_back(first)  # twice: still each once
    assert pool.free == (H100_0, H100_1, A10)
    assert pool.take(0, who="a cpu job") == ()
