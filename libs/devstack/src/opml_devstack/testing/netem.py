"""Test hosts behind emulated links, in network namespaces: a userspace netem.

This machine's kernel has no ``netem`` qdisc, so a link's delay and loss are made by a process that
forwards Ethernet frames between two veth ends in a namespace of their own (the *wire*): each frame
read from one end is written to the other ``delay_ms`` later, in order, unless it is dropped (with
probability ``loss``). The rate is a token bucket on the link's ends (``tc ... tbf``). Every packet
crosses it, whatever the protocol or direction, as on a real slow, distant, lossy link:

    root namespace            wire namespace                 host namespace
    <tag>r (10.x.y.1) <-veth-> <tag>a  [forwarder]  <tag>b <-veth-> <tag>h (10.x.y.2)

Offloads are turned off on the ends that send into the wire (segmentation, checksums), since a
forwarded frame must be a whole, checksummed one. :func:`cut` makes the wire drop every frame (the
interfaces stay up, connections hang, as when a site's uplink fails: SIGUSR1 to the forwarder) and
:func:`restore` lets them through again (SIGUSR2). Needs root and iproute2.

``python -m opml_devstack.testing.netem offloads-off DEV`` and
``python -m opml_devstack.testing.netem forward A B --delay-ms D --loss P`` are what the helpers run.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import heapq
import os
import random
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

SIOCETHTOOL = 0x8946
# legacy ethtool set commands: scatter-gather, TCP segmentation, generic segmentation and receive
# offloads, then TX checksums (off last: the others depend on it)
_OFFLOADS = (0x19, 0x1F, 0x24, 0x2C, 0x17)  # ETHTOOL_SSG, _STSO, _SGSO, _SGRO, _STXCSUM
ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4


def offloads_off(device: str) -> None:
    """Turns off the offloads that leave frames unfinished (segmentation, checksums) on ``device``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for command in _OFFLOADS:
            value = struct.pack("II", command, 0)
            buffer = bytearray(value)
            address = _address_of(buffer)
            request = struct.pack("16sP", device.encode(), address)
            with contextlib.suppress(OSError):  # an offload the device does not have
                fcntl.ioctl(probe.fileno(), SIOCETHTOOL, request)


def _address_of(buffer: bytearray) -> int:
    import ctypes
    return ctypes.addressof((ctypes.c_char * len(buffer)).from_buffer(buffer))


def forward(a: str, b: str, *, delay_ms: float, loss: float, seed: int = 0) -> None:
    """Forwards frames between devices ``a`` and ``b`` until SIGTERM (see the module)."""
    rng = random.Random(seed)
    sockets = {}
    for name in (a, b):
        sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        sock.bind((name, 0))
        sock.setblocking(False)
        sockets[name] = sock
    other = {sockets[a].fileno(): sockets[b], sockets[b].fileno(): sockets[a]}
    due: list[tuple[float, int, socket.socket, bytes]] = []
    order = 0
    running, broken = True, False

    def stop(*_: object) -> None:
        nonlocal running
        running = False

    def set_broken(signum: int, _: object) -> None:
        nonlocal broken
        broken = signum == signal.SIGUSR1

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGUSR1, set_broken)
    signal.signal(signal.SIGUSR2, set_broken)
    while running:
        timeout = max(0.0, due[0][0] - time.monotonic()) if due else 0.5
        with contextlib.suppress(InterruptedError):
            ready, _, _ = select.select(list(sockets.values()), [], [], timeout)
            for sock in ready:
                while True:
                    try:
                        frame, address = sock.recvfrom(65536)
                    except BlockingIOError:
                        break
                    if address[2] == PACKET_OUTGOING or broken or rng.random() < loss:
                        continue  # our own writes, seen again; or lost on the way (all of them while cut)
                    order += 1
                    heapq.heappush(due, (time.monotonic() + delay_ms / 1000, order, other[sock.fileno()], frame))
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, _, target, frame = heapq.heappop(due)
            with contextlib.suppress(OSError):  # the far end is down (a cut): the frame is lost
                target.send(frame)


def _run(*args: str) -> None:
    subprocess.run(list(args), check=True, capture_output=True, text=True)


@dataclass
class EmulatedHost:
    """A namespace behind an emulated link; ``address`` is its IP, ``gateway`` the root side's."""

    namespace: str
    address: str
    gateway: str
    root_device: str
    wire: str | None = None
    forwarder: subprocess.Popen | None = field(default=None, repr=False)

    def exec(self, *command: str) -> list[str]:
        """``command`` run in the host's namespace (as ``subprocess`` arguments)."""
        return ["ip", "netns", "exec", self.namespace, *command]


def cut(host: EmulatedHost) -> None:
    """Nothing crosses the host's link until :func:`restore` (a host with an emulated link only)."""
    assert host.forwarder is not None, f"{host.namespace} has a plain veth, not an emulated link"
    host.forwarder.send_signal(signal.SIGUSR1)


def restore(host: EmulatedHost) -> None:
    assert host.forwarder is not None, f"{host.namespace} has a plain veth, not an emulated link"
    host.forwarder.send_signal(signal.SIGUSR2)


@contextlib.contextmanager
def emulated_hosts(links: list[dict], *, tag: str | None = None) -> Iterator[list[EmulatedHost]]:
    """One namespace per entry of ``links`` (``{"rate_mbit": 10, "delay_ms": 25, "loss": 0.01}``; an
    empty dict: a plain veth, a host next door), each with its link; all removed at the end, even
    when making one failed. ``delay_ms`` is one way (the round trip is twice it)."""
    assert os.geteuid() == 0, "network namespaces need root"
    tag = tag or f"{os.getpid() % 10000:04d}"
    made: list[EmulatedHost] = []
    try:
        for index, link in enumerate(links):
            name = f"n{tag}{index}"
            subnet = f"10.{180 + index}.{int(tag) % 250}"
            host = EmulatedHost(name, f"{subnet}.2", f"{subnet}.1", f"{name}r")
            made.append(host)
            _run("ip", "netns", "add", name)
            inner = f"{name}h"
            if link.get("delay_ms") or link.get("loss"):
                host.wire = f"w{tag}{index}"
                _run("ip", "netns", "add", host.wire)
                _run("ip", "link", "add", host.root_device, "type", "veth", "peer", "name", f"{name}a")
                _run("ip", "link", "add", f"{name}b", "type", "veth", "peer", "name", inner)
                _run("ip", "link", "set", f"{name}a", "netns", host.wire)
                _run("ip", "link", "set", f"{name}b", "netns", host.wire)
                for device in (f"{name}a", f"{name}b"):
                    _run("ip", "netns", "exec", host.wire, "ip", "link", "set", device, "up")
            else:
                _run("ip", "link", "add", host.root_device, "type", "veth", "peer", "name", inner)
            _run("ip", "link", "set", inner, "netns", name)
            _run("ip", "addr", "add", f"{host.gateway}/24", "dev", host.root_device)
            _run("ip", "link", "set", host.root_device, "up")
            _run("ip", "netns", "exec", name, "ip", "addr", "add", f"{host.address}/24", "dev", inner)
            _run("ip", "netns", "exec", name, "ip", "link", "set", inner, "up")
            _run("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
            if host.wire is not None:
                me = [sys.executable, "-m", "opml_devstack.testing.netem"]
                _run(*me, "offloads-off", host.root_device)
                _run("ip", "netns", "exec", name, *me, "offloads-off", inner)
                host.forwarder = subprocess.Popen(
                    ["ip", "netns", "exec", host.wire, *me, "forward", f"{name}a", f"{name}b",
                     "--delay-ms", str(link.get("delay_ms", 0)), "--loss", str(link.get("loss", 0))])
            if link.get("rate_mbit"):
                for prefix, device in (((), host.root_device), (("ip", "netns", "exec", name), inner)):
                    _run(*prefix, "tc", "qdisc", "add", "dev", device, "root", "tbf", "rate",
                         f"{link['rate_mbit']}mbit", "burst", "32kbit", "latency", "400ms")
        yield made
    finally:
        for host in made:  # whatever still runs in a namespace goes with it
            pids = subprocess.run(["ip", "netns", "pids", host.namespace], capture_output=True, text=True).stdout
            for pid in pids.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            if host.forwarder is not None:
                host.forwarder.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    host.forwarder.wait(5)
                if host.forwarder.poll() is None:
                    host.forwarder.kill()
                    host.forwarder.wait()
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True)
            if host.wire is not None:
                subprocess.run(["ip", "netns", "del", host.wire], capture_output=True)
            subprocess.run(["ip", "link", "del", host.root_device], capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m opml_devstack.testing.netem")
    commands = parser.add_subparsers(dest="command", required=True)
    off = commands.add_parser("offloads-off")
    off.add_argument("device")
    wire = commands.add_parser("forward")
    wire.add_argument("a")
    wire.add_argument("b")
    wire.add_argument("--delay-ms", type=float, default=0.0)
    wire.add_argument("--loss", type=float, default=0.0)
    args = parser.parse_args()
    if args.command == "offloads-off":
        offloads_off(args.device)
    else:
        forward(args.a, args.b, delay_ms=args.delay_ms, loss=args.loss)


if __name__ == "__main__":
    main()
