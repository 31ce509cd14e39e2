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

Some VMs hide the far end: every link's remote PCI info reads FFFFFFFF:FF:FF.0
(2x H100, Firecracker, driver 580). Then NVML's NVLink P2P status
(`p2p_nvlink_status`) names the GPU's NVLink peers, and each gets NV<n>, n the
GPU's links that are up, when that is the only peer or every link ends at an
NVSwitch (`nvlink_remote_device_type`): on both boards each up link reaches
each NVLink peer. A capture made before P2P status was recorded: NV<n> only
when every remote answer is hidden and exactly one other GPU exists; else
unknown. NUMA node: sysfs, else NVML's memory affinity (`numa_affinity`) when
it names one node.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from gpuwatchd.errors import NvmlError
from gpuwatchd.model import GpuPlace, Topology
from gpuwatchd.pci import PciPlace, normalize_bus_id, pci_place, smi_relation
from gpuwatchd.sources.nvml.client import NvmlDevice, call_key

__all__ = ["GpuLinks", "LEVELS", "assemble", "cpu_list", "device_getter", "read_links"]

# nvmlGpuTopologyLevel_t -> nvidia-smi topo's name (INTERNAL: two GPUs of one board)
LEVELS = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
_NO_LINK = ("NOT_SUPPORTED", "INVALID_ARGUMENT")  # what NVML answers for a link not there
_RANK = {"PIX": 0, "PXB": 1, "PHB": 2, "NODE": 3, "SYS": 4}
_HIDDEN = 0xFFFFFFFF  # the domain NVML answers for a far end it may not show
_NVSWITCH = 2  # nvmlIntNvLinkDeviceType_t
Get = Callable[..., object]


@dataclass(frozen=True)
class GpuLinks:
    """What NVML says about one GPU's place: NVLink far ends, pair levels, CPUs."""

    remote: Mapping[str, int]  # far-end PCI bus id -> links
    levels: Mapping[int, str]  # other GPU's index -> PIX .. SYS
    cpus: str
    nvlinks_known: bool = True  # every link answered, or has none (else NVLinks are unknown)
    hidden: int = 0  # links whose far end NVML answered as FFFFFFFF:FF:FF.0
    active: int = 0  # links up at the last poll
    p2p_nvlink: Mapping[int, bool] = field(default_factory=dict)  # peer -> NVLink P2P OK
    switched: bool = False  # every hidden link ends at an NVSwitch
    numa_node: int | None = None  # NVML's memory affinity, when it names one node


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
    get: Get,
    nvlinks: int,
    peers: Sequence[int],
    failed: Mapping[str, str] | None = None,
    active: int = 0,
) -> GpuLinks:
    """One GPU's NVML topology calls; `get` answers None where NVML has no answer,
    `failed` (call key -> NVML code) says why: NOT_SUPPORTED is "no link", others unknown.
    `active`: the GPU's links up at its last poll."""
    remote: Counter[str] = Counter()
    known = True
    hidden: list[int] = []
    for link in range(nvlinks):
        info = get("nvlink_remote_pci_info", link)
        bus = normalize_bus_id(str(info.get("busId", ""))) if isinstance(info, dict) else ""
        if bus:
            remote[bus] += 1
        elif isinstance(info, dict) and info.get("domain") == _HIDDEN:
            hidden.append(link)
        elif (failed or {}).get(f"nvlink_remote_pci_info({link})") not in _NO_LINK:
            known = False
    levels = {}
    for peer in peers:
        level = get("topology_common_ancestor", peer)
        if isinstance(level, int) and level in LEVELS:
            levels[peer] = LEVELS[level]
    p2p: dict[int, bool] = {}
    switched = False
    if hidden:  # far ends not shown: which GPUs does NVLink reach?
        for peer in peers:
            status = get("p2p_nvlink_status", peer)
            if isinstance(status, int):
                p2p[peer] = status == 0
        if sum(p2p.values()) > 1:
            switched = all(get("nvlink_remote_device_type", n) == _NVSWITCH for n in hidden)
    masks = get("cpu_affinity")
    cpus = cpu_list(masks) if isinstance(masks, list) else ""
    nodes = get("numa_affinity")
    numa = cpu_list(nodes) if isinstance(nodes, list) else ""
    return GpuLinks(
        dict(remote),
        levels,
        cpus,
        known,
        hidden=len(hidden),
        active=active,
        p2p_nvlink=p2p,
        switched=switched,
        numa_node=int(numa) if numa.isdigit() else None,
    )


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
            fabric = min(switched.get(index, 0), switched.get(other, 0))
            nvlink = _nvlinks(got, other, other_bus, fabric, len(gpus))
            rel = nvlink or ""
            a, b = places[bus], places[other_bus]
            if nvlink is None or rel:
                pass  # joined by NVLink, or NVML could not say whether: no PCI guess
            elif got is not None and other in got.levels:
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
                numa_node=_numa(place, got),
                cpu_affinity=got.cpus if got else "",
                peers=tuple(peers),
                nics=tuple(near),
            )
        )
    return Topology(tuple(out))


def _nvlinks(
    got: GpuLinks | None, other: int, other_bus: str, fabric: int, gpus: int
) -> str | None:
    """NV<n> from a GPU to `other`, "" for no NVLink, None when NVML cannot say."""
    if got is None:
        return None
    direct = got.remote.get(other_bus, 0)
    if direct or fabric:
        return f"NV{direct or fabric}"
    if not got.nvlinks_known:
        return None
    if not got.hidden:
        return ""
    if got.remote or not got.active:
        return None  # some far ends shown, some hidden; or no link up: n unknown
    if other in got.p2p_nvlink:
        if not got.p2p_nvlink[other]:
            return ""
        alone = sum(got.p2p_nvlink.values()) == 1
        return f"NV{got.active}" if alone or got.switched else None
    if not got.p2p_nvlink and gpus == 2:
        return f"NV{got.active}"  # no P2P answer (older captures): the one other GPU
    return None


def _numa(place: PciPlace | None, got: GpuLinks | None) -> int | None:
    if place is not None and place.numa_node is not None:
        return place.numa_node
    return got.numa_node if got is not None else None


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
