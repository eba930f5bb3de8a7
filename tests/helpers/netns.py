"""Hosts on one machine for multi-node tests: Linux network namespaces joined by veth pairs
to a bridge, each namespace with its own address. Needs root; created and removed by
the test itself."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass


def can_make_namespaces() -> str:
    """ "" when namespaces can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    return ""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Host:
    name: str  # namespace
    address: str
    ifname: str

    def cmd(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]


class Network:
    """`Network(3)` makes hosts 10.<n>.0.1 .. 10.<n>.0.3; `close()` removes everything."""

    def __init__(self, count: int, tag: str | None = None) -> None:
        tag = tag or str(os.getpid() % 10000)
        self.bridge = f"tbr{tag}"
        subnet = 100 + int(tag) % 100
        self.hosts: list[Host] = []
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for i in range(count):
                self._host(tag, i, f"10.{subnet}.0.{i + 1}")
        except Exception:
            self.close()
            raise

    def _host(self, tag: str, i: int, address: str) -> None:
        ns, outside, inside = f"tnd{tag}h{i}", f"tv{tag}o{i}", f"tv{tag}i{i}"
        _ip("netns", "add", ns)
        self.hosts.append(Host(ns, address, inside))  # before the rest, so close() removes it
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", ns)
        _ip("link", "set", outside, "master", self.bridge)
        _ip("link", "set", outside, "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", inside)
        _ip("-n", ns, "link", "set", inside, "up")
        _ip("-n", ns, "link", "set", "lo", "up")

    def close(self) -> None:
        for h in self.hosts:
            subprocess.run(["ip", "netns", "del", h.name], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        self.hosts = []
