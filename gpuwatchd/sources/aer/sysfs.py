"""Finding the PCIe functions to watch and parsing their AER counter files.

Formats come from the kernel (drivers/pci/pcie/aer.c,
Documentation/ABI/testing/sysfs-bus-pci-devices-aer_stats): each of
`aer_dev_correctable`, `aer_dev_nonfatal` and `aer_dev_fatal` is one
"<error name> <count>" line per error bit, then `TOTAL_ERR_COR`,
`TOTAL_ERR_NONFATAL` or `TOTAL_ERR_FATAL` with the ERR_* messages the
device sent. Kernels before 5.x printed long names with spaces
("Receiver Error", "RELAY_NUM Rollover"), later ones the short ones
("RxErr", "Rollover"): the count is the last word of a line. Root ports
(and event collectors) also have `aer_rootport_total_err_cor`, `_fatal` and
`_nonfatal`: the messages that reached them from the whole hierarchy below.
The files exist only on functions with an AER capability and a kernel
with CONFIG_PCIEAER; a VM's emulated bus usually has none.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpuwatchd.pci import PciPlace, normalize_bus_id, pci_place, relation

__all__ = [
    "AerDevice",
    "DEV_FILES",
    "DevCounts",
    "ROLES",
    "ROOTPORT_FILES",
    "SEVERITIES",
    "discover",
    "parse_dev_file",
    "parse_total",
]

SEVERITIES = ("correctable", "nonfatal", "fatal")
DEV_FILES = {
    "correctable": "aer_dev_correctable",
    "nonfatal": "aer_dev_nonfatal",
    "fatal": "aer_dev_fatal",
}
ROOTPORT_FILES = {
    "correctable": "aer_rootport_total_err_cor",
    "nonfatal": "aer_rootport_total_err_nonfatal",
    "fatal": "aer_rootport_total_err_fatal",
}
ROLES = ("gpu", "nic", "bridge", "root_port")
_NVIDIA = "0x10de"
_GPU_CLASSES = ("0x0300", "0x0302")  # VGA and 3D controllers
_NIC_CLASS = "0x02"  # network controllers (Ethernet 0x0200, InfiniBand 0x0207)


@dataclass(frozen=True)
class DevCounts:
    """One aer_dev_* file: the TOTAL_ERR_* line and each error bit's count."""

    total: int
    by_error: Mapping[str, int] = field(default_factory=dict)


def parse_dev_file(text: str) -> DevCounts | None:
    """An aer_dev_* file's text -> its counts; None without a TOTAL_ERR_* line or on junk."""
    total: int | None = None
    by_error: dict[str, int] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        name, _, count = line.rstrip().rpartition(" ")
        name = name.strip()
        if not name or not count.isdigit():
            return None
        if name.startswith("TOTAL_ERR_"):
            total = int(count)
        else:
            by_error[name] = int(count)
    return None if total is None else DevCounts(total, by_error)


def parse_total(text: str) -> int | None:
    """An aer_rootport_total_err_* file: one decimal number."""
    value = text.strip()
    return int(value) if value.isdigit() else None


@dataclass(frozen=True)
class AerDevice:
    """A PCIe function whose AER counters are read, and what sits at or below it."""

    bus_id: str
    role: str  # one of ROLES
    path: str  # its sysfs directory
    root_port: str  # bus id of the root port above it ("" when it hangs off the host bridge)
    gpus: tuple[str, ...] = ()  # GPU labels at or below it (NVML index, else bus id)
    nics: tuple[str, ...] = ()  # NIC names at or below it


@dataclass
class _Endpoint:
    label: str
    role: str
    place: PciPlace
    dirs: tuple[str, ...]  # sysfs directory of each function of place.chain


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return ""


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _endpoint(sysfs: str, link: str, label: str, role: str) -> _Endpoint | None:
    place = pci_place(sysfs, link)
    if place is None:
        return None
    real = os.path.realpath(link)
    parts = real.split(os.sep)
    try:
        first = len(parts) - 1 - parts[::-1].index(place.chain[0])
    except ValueError:
        return None
    dirs = tuple(os.sep.join(parts[: first + 1 + i]) for i in range(len(place.chain)))
    return _Endpoint(label, role, place, dirs)


def _gpus(sysfs: str, known: Mapping[str, str]) -> list[_Endpoint]:
    """NVIDIA display/3D functions in bus/pci/devices, plus those NVML knows (bus id -> label)."""
    root = os.path.join(sysfs, "bus", "pci", "devices")
    found: dict[str, str] = {}
    for bus in _listdir(root):
        if _read(os.path.join(root, bus, "vendor")) != _NVIDIA:
            continue
        if _read(os.path.join(root, bus, "class")).startswith(_GPU_CLASSES):
            found[normalize_bus_id(bus) or bus] = bus
    for bus in known:
        found.setdefault(bus, bus)
    out = []
    for bus, name in sorted(found.items()):
        ep = _endpoint(sysfs, os.path.join(root, name), known.get(bus, bus), "gpu")
        if ep is not None:
            out.append(ep)
    return out


def _nics(sysfs: str, gpus: list[_Endpoint]) -> list[_Endpoint]:
    """RDMA devices (InfiniBand, RoCE) and Ethernet functions on a GPU's root complex."""
    by_bus: dict[str, _Endpoint] = {}
    ib = os.path.join(sysfs, "class", "infiniband")
    for name in _listdir(ib):
        ep = _endpoint(sysfs, os.path.join(ib, name, "device"), name, "nic")
        if ep is not None:
            by_bus.setdefault(ep.place.bus_id, ep)
    net = os.path.join(sysfs, "class", "net")
    for name in _listdir(net):
        link = os.path.join(net, name, "device")
        if not _read(os.path.join(link, "class")).startswith(_NIC_CLASS):
            continue
        ep = _endpoint(sysfs, link, name, "nic")
        if ep is None or ep.place.bus_id in by_bus:
            continue
        if any(relation(ep.place, g.place) in ("pcie_switch", "host_bridge") for g in gpus):
            by_bus[ep.place.bus_id] = ep
    return [by_bus[b] for b in sorted(by_bus)]


def discover(sysfs: str, known_gpus: Mapping[str, str]) -> list[AerDevice]:
    """Every GPU, nearby NIC and the bridges above them, each once, sorted by bus id.

    `known_gpus` maps the bus ids NVML lists to their labels (the GPU index).
    """
    gpus = _gpus(sysfs, known_gpus)
    endpoints = gpus + _nics(sysfs, gpus)
    roles: dict[str, tuple[str, str, str]] = {}  # bus -> role, path, root port
    below: dict[str, tuple[set[str], set[str]]] = {}
    for ep in endpoints:
        chain, dirs = ep.place.chain, ep.dirs
        root = chain[0] if len(chain) > 1 else ""
        for i, (bus, path) in enumerate(zip(chain, dirs, strict=True)):
            if i == len(chain) - 1:
                role = ep.role
            else:
                role = "root_port" if i == 0 else "bridge"
            roles.setdefault(bus, (role, path, root))
            gpus_below, nics_below = below.setdefault(bus, (set(), set()))
            (gpus_below if ep.role == "gpu" else nics_below).add(ep.label)
    return [
        AerDevice(
            bus,
            role,
            path,
            root,
            gpus=_sorted(below[bus][0]),
            nics=_sorted(below[bus][1]),
        )
        for bus, (role, path, root) in sorted(roles.items())
    ]


def _sorted(labels: Iterable[str]) -> tuple[str, ...]:
    return tuple(sorted(labels, key=lambda s: (len(s), s)))
