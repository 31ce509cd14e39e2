"""The node's GPU topology, as `nvidia-smi topo -m` shows it; read once per set of GPUs.

From NVML (through each GPU's reader, so under its deadline): the PCI
function at the far end of each NVLink (`nvlink_remote_pci_info`), the
closest common PCI ancestor of each GPU pair (`topology_common_ancestor`)
and the GPU's ideal CPUs (`cpu_affinity`). From sysfs (`paths.sysfs`): the
GPU's NUMA node and the RDMA devices (class/infiniband) nearest to it.

A pair joined by NVLinks is NV<n>, n the links from one to the other. On
NVSwitch boards a GPU's links end at switches, not at the peer: two GPUs
that both reach switches are NV<n> with n the fewer of their switch links,
which is what nvidia-smi prints there (NV18 on an HGX H100). Otherwise the
pair's PCI level (NVML's, else sysfs'), once NVML has said there is no NVLink
between them. Whatever NVML or sysfs cannot say stays unknown ("").
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gpuwatchd.errors import NvmlError
from gpuwatchd.model import GpuPlace, Topology
from gpuwatchd.pci import PciPlace, normalize_bus_id, pci_place, smi_relation
from gpuwatchd.sources.nvml.client import NvmlDevice, call_key

__all__ = ["GpuLinks", "LEVELS", "assemble", "cpu_list", "device_getter", "read_links"]

# nvmlGpuTopologyLevel_t -> nvidia-smi topo's name (INTERNAL: two GPUs of one board)
LEVELS = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
_NO_LINK = ("NOT_SUPPORTED", "INVALID_ARGUMENT")  # what NVML answers for a link not there
_RANK = {"PIX": 0, "PXB": 1, "PHB": 2, "NODE": 3, "SYS": 4}
Get = Callable[..., object]


@dataclass(frozen=True)
class GpuLinks:
    """What NVML says about one GPU's place: NVLink far ends, pair levels, CPUs."""

    remote: Mapping[str, int]  # far-end PCI bus id -> links
    levels: Mapping[int, str]  # other GPU's index -> PIX .. SYS
    cpus: str
    nvlinks_known: bool = True  # every link answered, or has none (else NVLinks are unknown)


def device_getter(device: NvmlDevice, failed: dict[str, str]) -> Get:
    """Calls on `device` that answer None on an NVML error and note its code in `failed`.

    Not the poll's getter: a topology call that fails must not count as a
    reading that newly fails (which would re-read the static calls).
    """

    def get(name: str, *args: int) -> object | None:
        key = call_key(name, args)
        try:
            return device.call(name, *args)
        except NvmlError as exc:
            if exc.code == "GPU_IS_LOST":
                raise
            failed[key] = exc.code
            return None

    return get


def read_links(
    get: Get, nvlinks: int, peers: Sequence[int], failed: Mapping[str, str] | None = None
) -> GpuLinks:
    """One GPU's NVML topology calls; `get` answers None where NVML has no answer,
    `failed` (call key -> NVML code) says why: NOT_SUPPORTED is "no link", others unknown."""
    remote: Counter[str] = Counter()
    known = True
    for link in range(nvlinks):
        info = get("nvlink_remote_pci_info", link)
        bus = normalize_bus_id(str(info.get("busId", ""))) if isinstance(info, dict) else ""
        if bus:
            remote[bus] += 1
        elif (failed or {}).get(f"nvlink_remote_pci_info({link})") not in _NO_LINK:
            known = False
    levels = {}
    for peer in peers:
        level = get("topology_common_ancestor", peer)
        if isinstance(level, int) and level in LEVELS:
            levels[peer] = LEVELS[level]
    masks = get("cpu_affinity")
    cpus = cpu_list(masks) if isinstance(masks, list) else ""
    return GpuLinks(dict(remote), levels, cpus, known)


def cpu_list(masks: Sequence[int]) -> str:
    """64-bit CPU masks, lowest CPUs first, as a kernel CPU list: [0xffffffff] -> "0-31"."""
    cpus = [w * 64 + b for w, mask in enumerate(masks) for b in range(64) if int(mask) >> b & 1]
    ranges: list[str] = []
    start = prev = None
    for cpu in [*cpus, None]:
        if cpu is not None and prev is not None and cpu == prev + 1:
            prev = cpu
            continue
        if start is not None:
            ranges.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = cpu
    return ",".join(ranges)


def assemble(
    gpus: Sequence[tuple[int, str, str]], links: Mapping[int, GpuLinks], sysfs: str
) -> Topology:
    """The matrix from each GPU's (index, bus id, uuid), its NVML links and sysfs."""
    buses = {bus: index for index, bus, _ in gpus}
    places = {bus: _place(sysfs, bus) for _, bus, _ in gpus}
    nics = _nics(sysfs)
    # links that end at an NVSwitch (or anything but a GPU of this node)
    switched = {i: sum(n for b, n in g.remote.items() if b not in buses) for i, g in links.items()}
    out = []
    for index, bus, uuid in gpus:
        got = links.get(index)
        peers = []
        for other, other_bus, _ in gpus:
            if other == index:
                continue
            direct = got.remote.get(other_bus, 0) if got else 0
            fabric = min(switched.get(index, 0), switched.get(other, 0))
            rel = f"NV{direct or fabric}" if direct or fabric else ""
            a, b = places[bus], places[other_bus]
            if rel or got is None or not got.nvlinks_known:
                pass  # joined by NVLink, or NVML could not say whether: no PCI guess
            elif other in got.levels:
                rel = got.levels[other]
            elif a is not None and b is not None:
                rel = smi_relation(a, b)
            peers.append((other, rel))
        place = places[bus]
        near: list[tuple[str, str]] = []
        if place is not None:
            ranked = sorted(
                (_RANK[r], name, r)
                for name, nic in nics
                if (r := smi_relation(place, nic)) != "SYS"
            )
            near = [(name, r) for rank, name, r in ranked if rank == ranked[0][0]]
        out.append(
            GpuPlace(
                index=index,
                pci_bus_id=bus,
                uuid=uuid,
                numa_node=place.numa_node if place is not None else None,
                cpu_affinity=got.cpus if got else "",
                peers=tuple(peers),
                nics=tuple(near),
            )
        )
    return Topology(tuple(out))


def _place(sysfs: str, bus: str) -> PciPlace | None:
    path = os.path.join(sysfs, "bus", "pci", "devices", bus)
    return pci_place(sysfs, path) if os.path.exists(path) else None


def _nics(sysfs: str) -> list[tuple[str, PciPlace]]:
    root = os.path.join(sysfs, "class", "infiniband")
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    found: list[tuple[str, PciPlace]] = []
    for name in names:
        place = pci_place(sysfs, os.path.join(root, name, "device"))
        if place is not None:
            found.append((name, place))
    return found
