"""PCI topology from sysfs: which GPUs sit close to a NIC.

A PCI function's sysfs directory is reached through symlinks
(/sys/class/infiniband/<dev>/device, /sys/bus/pci/devices/<bus id>) whose
real path lists every bridge above it:
/sys/devices/pci0000:16/0000:16:02.0/0000:17:00.0/0000:18:01.0/0000:19:00.0.
Two functions with a bridge in common below the host bridge share a PCIe
switch, so GPUDirect RDMA traffic between them need not cross the CPU;
nvidia-smi topo calls that PIX/PXB. The same root complex without a
common bridge is PHB; only the same NUMA node is NODE.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["AFFINITIES", "PciPlace", "gpu_affinity", "normalize_bus_id", "pci_place", "relation"]

AFFINITIES = ("pcie_switch", "host_bridge", "numa_node")
_ADDR = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


def normalize_bus_id(bus_id: str) -> str:
    """`00000000:1B:00.0` (NVML) -> `0000:1b:00.0` (sysfs)."""
    text = bus_id.strip().lower()
    domain, sep, rest = text.partition(":")
    if not sep or rest.count(":") != 1:
        return text
    try:
        return f"{int(domain, 16):04x}:{rest}"
    except ValueError:
        return text


@dataclass(frozen=True)
class PciPlace:
    """Where a PCI function hangs: its host bridge, the bridges above it, its NUMA node."""

    host: str  # e.g. pci0000:16
    chain: tuple[str, ...]  # bus ids from the root port down to the function itself
    numa_node: int | None

    @property
    def bus_id(self) -> str:
        return self.chain[-1] if self.chain else ""


def pci_place(sysfs: str, link: str) -> PciPlace | None:
    """Resolve a sysfs device link to its place in the PCI tree; None if not a PCI device."""
    real = os.path.realpath(link)
    rel = os.path.relpath(real, os.path.realpath(sysfs)).split(os.sep)
    if len(rel) < 3 or rel[0] != "devices" or not rel[1].startswith("pci"):
        return None
    chain = tuple(p for p in rel[2:] if _ADDR.match(p))
    if not chain:
        return None
    return PciPlace(rel[1], chain, _numa(real))


def _numa(devdir: str) -> int | None:
    try:
        with open(os.path.join(devdir, "numa_node"), encoding="ascii") as f:
            node = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def relation(a: PciPlace, b: PciPlace) -> str | None:
    """The closest affinity of two functions (see AFFINITIES), or None."""
    if a.host == b.host:
        common = 0
        for x, y in zip(a.chain[:-1], b.chain[:-1], strict=False):
            if x != y:
                break
            common += 1
        return "pcie_switch" if common else "host_bridge"
    if a.numa_node is not None and a.numa_node == b.numa_node:
        return "numa_node"
    return None


def gpu_affinity(sysfs: str, nic_link: str, gpus: Mapping[str, str]) -> dict[str, list[str]]:
    """GPU labels by affinity to the NIC at `nic_link`; `gpus` maps sysfs bus id -> label."""
    nic = pci_place(sysfs, nic_link)
    found: dict[str, list[str]] = {}
    if nic is None:
        return found
    for bus, label in sorted(gpus.items(), key=lambda kv: kv[1]):
        gpu = pci_place(sysfs, os.path.join(sysfs, "bus", "pci", "devices", bus))
        kind = relation(nic, gpu) if gpu is not None else None
        if kind is not None:
            found.setdefault(kind, []).append(label)
    return found
