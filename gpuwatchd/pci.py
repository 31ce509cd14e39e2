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

import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "AFFINITIES",
    "PciPlace",
    "UNKNOWN_BUS",
    "gpu_affinity",
    "normalize_bus_id",
    "pci_place",
    "relation",
    "smi_relation",
]

AFFINITIES = ("pcie_switch", "host_bridge", "numa_node")
# Shown for a report whose line names no bus id (e.g. a fall-off cut by a log shipper)
UNKNOWN_BUS = "unknown"
_HEX = frozenset("0123456789abcdefABCDEF")
_ADDR = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


@functools.lru_cache(maxsize=4096)  # a node has a handful of bus ids; reports repeat them
def normalize_bus_id(text: str) -> str:
    """`PCI:0000:00:06` / `00:06.0` / `0000:D8:00.0` -> `0000:00:06.0`; "" if not a bus id.

    NVML's form, lowercased, with a 4-digit domain. The driver's Xid lines
    print no function number: GPUs are function 0.
    """
    s = text.strip()
    if s[:4].upper() == "PCI:":
        s = s[4:]
    dev_part, dot, fn = s.partition(".")
    parts = dev_part.split(":")
    if len(parts) == 2:
        parts.insert(0, "0")
    if len(parts) != 3 or (dot and not fn):
        return ""
    fn = fn or "0"
    for p, low, high in ((parts[0], 1, 8), (parts[1], 2, 2), (parts[2], 2, 2), (fn, 1, 1)):
        if not low <= len(p) <= high or not set(p) <= _HEX:
            return ""
    dom, bus, dev, func = (int(p, 16) for p in (*parts, fn))
    if dev > 0x1F or func > 7:
        return ""
    return f"{dom:04x}:{bus:02x}:{dev:02x}.{func:x}"


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


def _bridges_shared(a: PciPlace, b: PciPlace) -> int:
    """How many bridges below their host bridge two functions have in common."""
    common = 0
    for x, y in zip(a.chain[:-1], b.chain[:-1], strict=False):
        if x != y:
            break
        common += 1
    return common


def relation(a: PciPlace, b: PciPlace) -> str | None:
    """The closest affinity of two functions (see AFFINITIES), or None."""
    if a.host == b.host:
        return "pcie_switch" if _bridges_shared(a, b) else "host_bridge"
    if a.numa_node is not None and a.numa_node == b.numa_node:
        return "numa_node"
    return None


def smi_relation(a: PciPlace, b: PciPlace) -> str:
    """The path between two functions in nvidia-smi topo's words: PIX, PXB, PHB, NODE, SYS.

    PIX: one PCIe switch between them (each at most one port below the bridge
    they share); PXB: more bridges, below the host bridge; PHB: only the root
    complex in common.
    """
    if a.host == b.host:
        common = _bridges_shared(a, b)
        if not common:
            return "PHB"
        below = max(len(a.chain) - 1 - common, len(b.chain) - 1 - common)
        return "PIX" if below <= 1 else "PXB"
    if a.numa_node is not None and a.numa_node == b.numa_node:
        return "NODE"
    return "SYS"


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
